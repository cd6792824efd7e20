//! The batch path of the [`DedupActor`](crate::DedupActor): several
//! messages in one transaction.
//!
//! One statement claims every message of the batch; the handlers run on
//! the whole batch (`handle_batch`) and every message is recorded; one
//! commit. If the handlers fail, the transaction is rolled back, the batch
//! claimed again in a new one, and each message run alone after a
//! savepoint of its own: a failing message is undone alone and takes its
//! failure path by itself, the others commit. A panic takes the
//! transaction with its connection: the message that panicked (found by
//! running each alone) is charged with it, and the others are claimed
//! again in a new transaction, uncharged.

use std::collections::HashSet;
use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::UnitOfWork;
use crate::actors::dedup::{DeliverBatch, Work, give_up, key, roll_back};
use crate::actors::handler::{Handled, Route};
use crate::actors::tally::Tally;
use crate::envelope::Envelope;
use crate::policy::{Abandoned, Outcome, Stage};
use crate::store::{Claim, InboxKey};

/// How the attempt on a whole batch ended.
enum WholeBatch {
    /// Every handler succeeded on the whole batch, and every message is
    /// recorded: ready to commit.
    Done(UnitOfWork),
    /// Something failed and the transaction can be rolled back: run the
    /// messages one at a time.
    Failed(UnitOfWork),
    /// A handler panicked, which message's is unknown, and the transaction
    /// went with the connection: run the messages one at a time.
    Panicked,
    /// The transaction is lost for a reason of the runtime's (a route
    /// vanished): every message starts over.
    Lost(Abandoned),
}

/// How a run of the claimed messages one at a time ended.
enum EachAlone {
    /// Every message has its outcome: the unit of work to commit.
    Done(UnitOfWork),
    /// A message panicked: it has its failure, and the transaction went
    /// with the connection, so those that were to complete in it are
    /// undecided again.
    Panicked,
}

impl Work {
    pub(crate) async fn process_batch(
        self,
        DeliverBatch {
            consumer, envelopes, ..
        }: DeliverBatch,
        lane: Arc<Semaphore>,
    ) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; envelopes.len()];
        // The messages to claim: one per id, with a handler. A second copy of
        // an id in the batch is a duplicate whatever becomes of the first:
        // that one is committed, or alive on its failure path.
        let mut seen = HashSet::new();
        let mut members = Vec::new();
        for (i, envelope) in envelopes.iter().enumerate() {
            if !self.routes.contains_key(&envelope.event_type) {
                outcomes[i] = Some(Outcome::NoHandler {
                    event_type: envelope.event_type.clone(),
                });
            } else if seen.insert(envelope.message_id) {
                members.push(i);
            } else {
                outcomes[i] = Some(Outcome::Duplicate);
            }
        }
        let keys: Vec<InboxKey> = members.iter().map(|&i| key(&consumer, &envelopes[i])).collect();

        if !members.is_empty() {
            match self
                .run_batch(&envelopes, &members, &keys, &mut outcomes, &lane)
                .await
            {
                Ok(uow) => {
                    if let Err(e) = uow.commit().await {
                        // Nothing committed: every message that was to
                        // complete goes back on its failure path.
                        for &i in &members {
                            if outcomes[i] == Some(Outcome::Completed) {
                                outcomes[i] =
                                    Some(Outcome::Abandoned(Abandoned::database(Stage::Commit, &e)));
                            }
                        }
                    }
                }
                // Nothing of the batch committed: every member without an
                // outcome of its own, or that was to complete, starts over.
                Err(abandoned) => {
                    for &i in &members {
                        if matches!(outcomes[i], None | Some(Outcome::Completed)) {
                            outcomes[i] = Some(Outcome::Abandoned(abandoned.clone()));
                        }
                    }
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::Abandoned(Abandoned::new(Stage::Runtime, "no outcome"))))
            .collect()
    }

    /// Claims the members and runs their handlers: on the whole batch
    /// first, then, if that fails, on each message after a savepoint of its
    /// own. Writes the members' outcomes (`Completed` meaning "completed if
    /// the commit succeeds"). Returns the unit of work to commit, or why the
    /// whole batch failed (every undecided or would-be-completed member is
    /// abandoned then).
    async fn run_batch(
        &self,
        envelopes: &[Arc<Envelope>],
        members: &[usize],
        keys: &[InboxKey],
        outcomes: &mut [Option<Outcome>],
        lane: &Semaphore,
    ) -> Result<UnitOfWork, Abandoned> {
        // The claim may run outside the lane: it locks only inbox rows,
        // which no handler waits for.
        let (uow, claimed) = self.claim(members, keys, outcomes).await?;
        if claimed.is_empty() {
            return Ok(uow);
        }
        // Held while the handlers run, released before the commit.
        let running = take_turn(lane).await?;
        // The whole batch first, without a savepoint: nearly every batch
        // commits whole, and under a savepoint each of its writes would be
        // a subtransaction's, which costs PostgreSQL more.
        let failed = match self
            .run_whole_batch(envelopes, members, keys, &claimed, uow)
            .await
        {
            WholeBatch::Done(uow) => {
                for &position in &claimed {
                    outcomes[members[position]] = Some(Outcome::Completed);
                }
                return Ok(uow);
            }
            WholeBatch::Failed(failed) => Some(failed),
            WholeBatch::Panicked => None,
            WholeBatch::Lost(abandoned) => return Err(abandoned),
        };
        // Undone whole, claims included (a panic took the transaction with
        // its connection), and claimed again in a new transaction
        // (meanwhile another batch may have completed a member: it is a
        // duplicate now), then one message at a time. The turn is given
        // back for the claim, as for the first: a batch of this queue that
        // claimed a copy of a member while the claims were undone holds its
        // row and waits for the turn, and would wait until
        // `database.lock_timeout` for a claim made while holding it.
        self.stats.add(Tally::BatchesSplit);
        drop(running);
        if let Some(failed) = failed {
            roll_back(failed).await?;
        }
        // A panic alone costs a transaction: the message that panicked has
        // its failure, and the others are claimed again and go on. Each
        // round decides one more message, so this ends.
        loop {
            let (uow, claimed) = self.claim(members, keys, outcomes).await?;
            let _running = take_turn(lane).await?;
            match self
                .run_each_alone(envelopes, members, keys, &claimed, outcomes, uow)
                .await?
            {
                EachAlone::Done(uow) => return Ok(uow),
                EachAlone::Panicked => {
                    for &i in members {
                        if outcomes[i] == Some(Outcome::Completed) {
                            outcomes[i] = None;
                        }
                    }
                }
            }
        }
    }

    /// Opens the batch's unit of work and claims, in one statement, the
    /// members without an outcome yet (all of them but after a panic);
    /// writes `Duplicate` for those already processed. Returns the unit of
    /// work and the positions (in `members` and `keys`) of the messages to
    /// process.
    async fn claim(
        &self,
        members: &[usize],
        keys: &[InboxKey],
        outcomes: &mut [Option<Outcome>],
    ) -> Result<(UnitOfWork, Vec<usize>), Abandoned> {
        let mut claimed: Vec<usize> = (0..members.len())
            .filter(|&position| outcomes[members[position]].is_none())
            .collect();
        let some: Vec<InboxKey>;
        let wanted = if claimed.len() == keys.len() {
            keys
        } else {
            some = claimed.iter().map(|&position| keys[position].clone()).collect();
            &some
        };
        let mut uow = self.begin().await?;
        let claiming = std::time::Instant::now();
        let claims = self.store.try_begin_batch(&mut uow, wanted).await;
        self.claim_wait.record(claiming.elapsed().as_secs_f64());
        let mut claims = match claims {
            Ok(claims) => claims.into_iter(),
            Err(e) => return Err(give_up(uow, Stage::InboxClaim, &e).await),
        };
        // A store that answered fewer claims than asked leaves the rest
        // without an outcome: abandoned, never acked.
        claimed.retain(|&position| match claims.next() {
            Some(Claim::Proceed) => true,
            Some(Claim::Duplicate) => {
                outcomes[members[position]] = Some(Outcome::Duplicate);
                false
            }
            None => false,
        });
        Ok((uow, claimed))
    }

    /// After the whole batch failed: runs each claimed message alone, after
    /// a savepoint of its own, so that a failing one is undone alone and
    /// the others commit. Fills in each one's outcome; stops at a panic,
    /// which only the message that panicked is charged for.
    async fn run_each_alone(
        &self,
        envelopes: &[Arc<Envelope>],
        members: &[usize],
        keys: &[InboxKey],
        claimed: &[usize],
        outcomes: &mut [Option<Outcome>],
        mut uow: UnitOfWork,
    ) -> Result<EachAlone, Abandoned> {
        for &position in claimed {
            let (i, key) = (members[position], &keys[position]);
            let envelope = Arc::clone(&envelopes[i]);
            let route = self.route(&envelope.event_type)?;
            let saved = uow
                .savepoint()
                .map_err(|e| Abandoned::database(Stage::Savepoint, &e))?;
            let failure = match Arc::clone(route).run(vec![envelope], saved).await {
                Handled::Done(mut done) => match self.store.complete(&mut done, key).await {
                    Ok(()) => {
                        outcomes[i] = Some(Outcome::Completed);
                        uow = done;
                        continue;
                    }
                    Err(e) => {
                        uow = done;
                        Outcome::Abandoned(Abandoned::database(Stage::InboxRecord, &e))
                    }
                },
                Handled::Failed {
                    uow: Some(failed),
                    failure,
                } => {
                    uow = failed;
                    failure.into()
                }
                // A panic took the connection with it: this message has its
                // failure, the others start over, uncharged.
                Handled::Failed { uow: None, failure } => {
                    outcomes[i] = Some(failure.into());
                    return Ok(EachAlone::Panicked);
                }
            };
            // This message alone is undone; the batch goes on.
            uow = uow
                .rollback_to_savepoint()
                .await
                .map_err(|e| Abandoned::database(Stage::RollbackToSavepoint, &e))?;
            if let Err(e) = self.store.abandon(&mut uow, key).await {
                return Err(Abandoned::database(Stage::InboxAbandon, &e));
            }
            outcomes[i] = Some(failure);
        }
        Ok(EachAlone::Done(uow))
    }

    /// Runs the handlers on the claimed messages all at once (their
    /// `handle_batch`), type by type in order of first appearance, then
    /// records every message.
    async fn run_whole_batch(
        &self,
        envelopes: &[Arc<Envelope>],
        members: &[usize],
        keys: &[InboxKey],
        claimed: &[usize],
        mut uow: UnitOfWork,
    ) -> WholeBatch {
        let mut by_type: Vec<(&str, Vec<Arc<Envelope>>)> = Vec::new();
        for &position in claimed {
            let envelope = &envelopes[members[position]];
            match by_type.iter_mut().find(|(t, _)| *t == envelope.event_type) {
                Some((_, group)) => group.push(Arc::clone(envelope)),
                None => by_type.push((&envelope.event_type, vec![Arc::clone(envelope)])),
            }
        }
        for (event_type, group) in by_type {
            let route = match self.route(event_type) {
                Ok(route) => route,
                Err(abandoned) => return WholeBatch::Lost(abandoned),
            };
            let size = group.len();
            match Arc::clone(route).run(group, uow).await {
                Handled::Done(done) => uow = done,
                Handled::Failed {
                    uow: Some(failed),
                    failure,
                } => {
                    tracing::debug!(
                        size,
                        ?failure,
                        "the handlers failed on the batch; running its messages one at a time"
                    );
                    return WholeBatch::Failed(failed);
                }
                // A panic took the connection with it, and which message
                // caused it is unknown: each runs alone, and the one that
                // panics again is the one charged.
                Handled::Failed { uow: None, failure } => {
                    tracing::debug!(
                        size,
                        ?failure,
                        "a handler panicked on the batch; running its messages one at a time"
                    );
                    return WholeBatch::Panicked;
                }
            }
        }
        for &position in claimed {
            if let Err(e) = self.store.complete(&mut uow, &keys[position]).await {
                tracing::debug!(error = %e, "recording the batch failed; running its messages one at a time");
                return WholeBatch::Failed(uow);
            }
        }
        WholeBatch::Done(uow)
    }

    /// The route of a type that had one when the batch was sorted.
    fn route(&self, event_type: &str) -> Result<&Route, Abandoned> {
        self.routes
            .get(event_type)
            .ok_or_else(|| Abandoned::new(Stage::Runtime, "route vanished"))
    }
}

/// One of the queue's turns to run handlers (`queues[].concurrent_batches`).
async fn take_turn(lane: &Semaphore) -> Result<tokio::sync::SemaphorePermit<'_>, Abandoned> {
    lane.acquire()
        .await
        .map_err(|e| Abandoned::new(Stage::BatchTurn, e))
}
