//! One limit over every connection the runtime takes.
//!
//! The pool may be larger than what the server grants: its
//! `max_connections`, or the role's `CONNECTION LIMIT`, shared with other
//! instances and other services. A new connection past that is refused
//! (53300) while the pool holds others. That is no outage, and nothing a
//! message did: failing the checkout would hold the message as for an
//! outage, the database would answer at once, and after a few such holds
//! the message would spend its attempts and walk the retry tiers for a
//! setting's fault; asking again at once would cost the server a refused
//! connection at each turn. So the limit comes down to the connections the
//! pool holds, and whoever needs one (a message's unit of work, the
//! outbox's rounds, retention, the redelivery counter, the availability
//! probe, the application's `unit_of_work()`) waits for one of them, as for
//! a full pool.
//!
//! Slots free up elsewhere (another instance stops, a deploy ends), so the
//! limit does not stay down: while work waits for a slot, the limit is
//! raised by one (the first waiter's new connection is the try) a pause
//! after the refusal, and by one more every [`FIRST_GROWTH_PAUSE`] while
//! the server takes them, up to the pool's size. A try the server refuses
//! lowers the limit again, and the pause before the next doubles (from
//! [`FIRST_GROWTH_PAUSE`] up to [`MAX_GROWTH_PAUSE`]): a server that stays
//! full costs one refused connection per pause. No try is made while
//! nothing waits: the connections open are then enough.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use deadpool_postgres::{Object, Pool, PoolError, TimeoutType};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// The pause before the first try at one more connection after a refusal.
pub(crate) const FIRST_GROWTH_PAUSE: Duration = Duration::from_secs(1);
/// The longest pause between tries while the server keeps refusing.
pub(crate) const MAX_GROWTH_PAUSE: Duration = Duration::from_secs(30);

/// The runtime's connections: its pool, behind the gate every one of them
/// goes through. Cheap to clone: clones share the gate.
#[derive(Clone)]
pub(crate) struct Connections {
    pool: Pool,
    /// `None` over a pool the application made (the tools a test or an
    /// operator runs): nothing else shares it, so nothing to gate.
    gate: Option<Arc<Gate>>,
}

/// A pooled connection and the slot it takes, given back after it.
pub(crate) struct Connection {
    /// Dropped first (fields drop in order): back in the pool before its
    /// slot is free, so the waiter that takes the slot finds it idle.
    object: Object,
    slot: Option<Slot>,
}

impl Connection {
    /// Closes the connection instead of giving it back to the pool (one
    /// stuck, or to a server of no use), then frees its slot.
    pub(crate) fn discard(self) {
        let Self { object, slot } = self;
        drop(Object::take(object));
        drop(slot);
    }

    /// The pooled connection and its slot, to keep together elsewhere (a
    /// unit of work holds both, the slot dropped after the connection).
    pub(crate) fn into_parts(self) -> (Object, Option<Slot>) {
        (self.object, self.slot)
    }
}

impl std::ops::Deref for Connection {
    type Target = Object;

    fn deref(&self) -> &Object {
        &self.object
    }
}

/// A connection from a pool outside any gate.
impl From<Object> for Connection {
    fn from(object: Object) -> Self {
        Self { object, slot: None }
    }
}

/// Connections of a pool outside any gate: the application's own.
impl From<Pool> for Connections {
    fn from(pool: Pool) -> Self {
        Self { pool, gate: None }
    }
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut debug = f.debug_struct("Connections");
        debug.field("pool_size", &self.pool_size());
        if let Some(gate) = &self.gate {
            debug.field("limit", &gate.limit().granted);
        }
        debug.finish_non_exhaustive()
    }
}

impl Connections {
    /// The runtime's connections, gated: created once per runtime, shared
    /// by all its parts, so a limit learnt by one holds for all, and it
    /// outlives the restarts of the actors that use it.
    pub(crate) fn gated(pool: Pool) -> Self {
        let gate = Gate::new(pool.status().max_size);
        Self {
            pool,
            gate: Some(Arc::new(gate)),
        }
    }

    /// The pool behind the gate.
    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Closes the pool, and the gate with it: whoever waits for a slot
    /// gets [`PoolError::Closed`] at once.
    pub(crate) fn close(&self) {
        self.pool.close();
        if let Some(gate) = &self.gate {
            gate.permits.close();
        }
    }

    /// `database.pool_size`: the most connections there may be.
    pub(crate) fn pool_size(&self) -> usize {
        self.pool.status().max_size
    }

    /// Whether every connection there may be now is taken: the database is
    /// answering those who hold them, and a new taker would wait.
    pub(crate) fn is_full(&self) -> bool {
        match &self.gate {
            Some(gate) => gate.permits.available_permits() == 0,
            None => {
                let status = self.pool.status();
                status.available == 0 && status.size == status.max_size
            }
        }
    }

    /// A connection, once a slot is free: waits no longer than the pool
    /// waits for a connection (`database.transaction_timeout`) for either.
    /// A new connection the server refuses for want of slots, while the
    /// pool holds others, lowers the limit and waits for one of those.
    pub(crate) async fn get(&self) -> Result<Connection, PoolError> {
        let Some(gate) = &self.gate else {
            return self.pool.get().await.map(Connection::from);
        };
        loop {
            let slot = gate.slot(self.pool.timeouts().wait).await?;
            match self.pool.get().await {
                Ok(object) => {
                    return Ok(Connection {
                        object,
                        slot: Some(slot),
                    });
                }
                Err(PoolError::Backend(e))
                    if crate::error::no_slot_left(&e) && self.pool.status().size > 0 =>
                {
                    // Lowered while this slot is still taken: given back
                    // after, it is one of those the limit no longer has,
                    // and cannot go to a waiter instead.
                    gate.refused(self.pool.status().size);
                    drop(slot);
                }
                // With no connection open, a refusal is no limit to learn:
                // the caller waits for the database as for an outage.
                Err(e) => return Err(e),
            }
        }
    }
}

/// The limit and its slots.
struct Gate {
    /// One per connection that may be taken now: the limit's, less those
    /// taken, less those [`owed`](Self::owed).
    permits: Arc<Semaphore>,
    /// Slots the limit came down by while they were taken: each is
    /// forgotten as it is given back, not handed to a waiter. (Forgetting
    /// only the free ones would leave the limit up whenever work waits,
    /// since a slot given back goes straight to the first waiter.)
    owed: AtomicUsize,
    /// `database.pool_size`: the limit never goes above it.
    pool_size: usize,
    limit: Mutex<Limit>,
}

/// The limit, and when to try it higher.
struct Limit {
    /// The connections that may be taken at once.
    granted: usize,
    /// When one more may be tried, if work waits.
    next_try: Instant,
    /// The pause after the next try.
    pause: Duration,
    /// Whether the server refused a connection since the last try.
    refused_since_try: bool,
    /// The limit before the tries since the last refusal: a refusal that
    /// brings it no lower is one try turned down, not news for the log.
    before_tries: Option<usize>,
}

impl Gate {
    fn new(pool_size: usize) -> Self {
        crate::actors::metrics::database_connection_limit(pool_size);
        Self {
            permits: Arc::new(Semaphore::new(pool_size)),
            owed: AtomicUsize::new(0),
            pool_size,
            limit: Mutex::new(Limit {
                granted: pool_size,
                next_try: Instant::now(),
                pause: FIRST_GROWTH_PAUSE,
                refused_since_try: false,
                before_tries: None,
            }),
        }
    }

    fn limit(&self) -> MutexGuard<'_, Limit> {
        // Nothing panics while holding it; were it poisoned, its numbers
        // are still whole.
        self.limit.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A free slot, or the first given back within `wait`. While it waits
    /// below the pool's size, it tries the limit higher when due.
    async fn slot(self: &Arc<Self>, wait: Option<Duration>) -> Result<Slot, PoolError> {
        // A free slot is the rule: taken without a timer, which would cost
        // every message a registration.
        if let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() {
            return Ok(self.slot_of(permit));
        }
        let deadline = wait.map(|wait| Instant::now() + wait);
        // Pinned outside the loop: it keeps its place in the queue.
        let mut acquire = std::pin::pin!(Arc::clone(&self.permits).acquire_owned());
        loop {
            let wake = match (deadline, self.next_try()) {
                (Some(deadline), Some(next_try)) => Some(deadline.min(next_try)),
                (deadline, next_try) => deadline.or(next_try),
            };
            tokio::select! {
                biased;
                permit = &mut acquire => {
                    return permit.map(|permit| self.slot_of(permit)).map_err(|_| PoolError::Closed);
                }
                () = until(wake) => {
                    if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                        return Err(PoolError::Timeout(TimeoutType::Wait));
                    }
                    self.try_one_more();
                }
            }
        }
    }

    fn slot_of(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Slot {
        Slot {
            permit: Some(permit),
            gate: Arc::clone(self),
        }
    }

    /// When one more connection may be tried: `None` at the pool's size.
    fn next_try(&self) -> Option<Instant> {
        let limit = self.limit();
        (limit.granted < self.pool_size).then_some(limit.next_try)
    }

    /// Raises the limit by one, if below the pool's size and due. The slot
    /// goes to the first waiter, whose connection is the try: refused, it
    /// lowers the limit again.
    fn try_one_more(&self) {
        let mut limit = self.limit();
        let now = Instant::now();
        if limit.granted >= self.pool_size || now < limit.next_try {
            return;
        }
        // The last try was not refused: the server has room again, so
        // refusals start over from the first pause.
        if !limit.refused_since_try {
            limit.pause = FIRST_GROWTH_PAUSE;
        }
        limit.refused_since_try = false;
        // The next try follows soon; a refusal of this one pushes it back
        // by the pause instead.
        limit.next_try = now + FIRST_GROWTH_PAUSE;
        let granted = limit.granted;
        limit.before_tries.get_or_insert(granted);
        limit.granted += 1;
        let owed_one = self
            .owed
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |owed| owed.checked_sub(1))
            .is_ok();
        if !owed_one {
            self.permits.add_permits(1);
        }
        crate::actors::metrics::database_connection_limit(limit.granted);
        if limit.granted == self.pool_size {
            limit.before_tries = None;
            tracing::info!(
                limit = limit.granted,
                "the database takes connections again: the limit is back at database.pool_size"
            );
        } else {
            tracing::debug!(
                limit = limit.granted,
                pool_size = self.pool_size,
                "trying one more database connection"
            );
        }
    }

    /// The server refused a new connection for want of slots while the
    /// pool held `open`: the limit comes down to them.
    fn refused(&self, open: usize) {
        let mut limit = self.limit();
        let target = open.max(1);
        if target >= limit.granted {
            // Another refusal of the same moment lowered it already.
            return;
        }
        let now = Instant::now();
        limit.next_try = now + limit.pause;
        limit.pause = (limit.pause * 2).min(MAX_GROWTH_PAUSE);
        limit.refused_since_try = true;
        let excess = limit.granted - target;
        let forgotten = self.permits.forget_permits(excess);
        self.owed.fetch_add(excess - forgotten, Ordering::SeqCst);
        let was = std::mem::replace(&mut limit.granted, target);
        crate::actors::metrics::database_connection_limit(target);
        match limit.before_tries.take() {
            Some(before) if target >= before => tracing::debug!(
                limit = target,
                next_try_in = ?limit.next_try - now,
                "the database refused one more connection; trying again later"
            ),
            _ => tracing::warn!(
                open,
                limit = target,
                was,
                pool_size = self.pool_size,
                "the database refused a new connection for want of slots (53300): the runtime's work now \
                 shares the connections open, and one more is tried from time to time while work waits; {}",
                crate::error::NO_SLOT_LEFT_HINT
            ),
        }
    }
}

/// Sleeps until `when`; forever if `None`.
async fn until(when: Option<Instant>) {
    match when {
        Some(when) => tokio::time::sleep_until(when).await,
        None => std::future::pending().await,
    }
}

/// A slot taken: given back on drop, or forgotten if the limit came down
/// while it was taken.
pub(crate) struct Slot {
    /// `Some` until dropped.
    permit: Option<OwnedSemaphorePermit>,
    gate: Arc<Gate>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let owed = self
            .gate
            .owed
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |owed| owed.checked_sub(1))
            .is_ok();
        if owed {
            permit.forget();
        }
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    fn gate(pool_size: usize) -> Arc<Gate> {
        Arc::new(Gate::new(pool_size))
    }

    /// `waited` is `pause`, to the timer's millisecond.
    fn about(waited: Duration, pause: Duration) {
        assert!(
            waited >= pause && waited <= pause + Duration::from_millis(2),
            "waited {waited:?}, not {pause:?}"
        );
    }

    async fn take(gate: &Arc<Gate>, n: usize) -> Vec<Slot> {
        let mut slots = Vec::new();
        for _ in 0..n {
            slots.push(gate.slot(None).await.unwrap());
        }
        slots
    }

    /// A slot given back while work waits goes to the first waiter, not to
    /// the semaphore's free permits: the limit must come down all the same.
    #[tokio::test(start_paused = true)]
    async fn a_refusal_while_work_waits_lowers_the_limit_as_slots_come_back() {
        let gate = gate(4);
        let mut taken = take(&gate, 4).await;
        let mut waiter = Box::pin(gate.slot(None));
        assert!((&mut waiter).now_or_never().is_none());

        gate.refused(2);
        assert_eq!(gate.limit().granted, 2);
        taken.truncate(2);
        assert!(
            (&mut waiter).now_or_never().is_none(),
            "two slots given back, both above the limit"
        );
        taken.truncate(1);
        let slot = (&mut waiter)
            .now_or_never()
            .expect("a slot within the limit")
            .unwrap();
        assert_eq!(gate.permits.available_permits(), 0);
        drop((slot, taken));
        assert_eq!(gate.permits.available_permits(), 2, "the limit's two, no more");
    }

    /// While work waits, the limit goes up by one after the pause, then by
    /// one each pause while not refused; a refused try lowers it and
    /// doubles the pause; it never passes the pool's size.
    #[tokio::test(start_paused = true)]
    async fn the_limit_grows_back_while_work_waits_and_backs_off_when_refused() {
        let gate = gate(3);
        let mut taken = take(&gate, 3).await;
        gate.refused(1);
        taken.truncate(1);
        assert_eq!(gate.permits.available_permits(), 0);

        let started = Instant::now();
        let second = gate.slot(None).await.unwrap();
        about(started.elapsed(), FIRST_GROWTH_PAUSE);
        assert_eq!(gate.limit().granted, 2);

        // The server refuses the try: down again, and the next try waits
        // twice as long.
        gate.refused(1);
        drop(second);
        let started = Instant::now();
        let second = gate.slot(None).await.unwrap();
        about(started.elapsed(), FIRST_GROWTH_PAUSE * 2);

        // Taken this time: the next follows a first pause later, up to the
        // pool's size and no further.
        let started = Instant::now();
        let third = gate.slot(None).await.unwrap();
        about(started.elapsed(), FIRST_GROWTH_PAUSE);
        assert_eq!(gate.limit().granted, 3);
        assert_eq!(gate.next_try(), None, "at the pool's size");
        let fourth = gate.slot(Some(Duration::from_secs(60))).await;
        assert!(matches!(fourth, Err(PoolError::Timeout(TimeoutType::Wait))));
        drop((taken, second, third));
        assert_eq!(gate.permits.available_permits(), 3);
    }
}
