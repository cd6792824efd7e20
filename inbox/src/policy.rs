//! The failure policy: what becomes of a delivery after an attempt, decided
//! in one place, by one pure function, [`decide`].
//!
//! An attempt ends in an [`Outcome`]; [`decide`] turns it, with the
//! message's [`FailureHistory`] and the `[failure]` settings, into an
//! [`Action`]: ack, hold while the database is away, retry in process
//! after a backoff, or move the message (to a retry tier, `Q.error` or
//! `Q.skipped`) with the history to stamp on it. The runtime carries the
//! action out and counts it once it is done.

use std::fmt;
use std::time::Duration;

use crate::fault::FailureHistory;
use crate::settings::FailureSettings;

/// How many times in a row a message may be held for an outage while the
/// database answers at once, before the failure counts as an attempt: a
/// message whose handler kills its own connection would otherwise loop
/// hot, holding and retrying forever.
pub(crate) const MAX_HOLDS_IN_VAIN: u32 = 3;

/// Where a message failed: a runtime stage, or a handler by name. Its
/// `Display` is the value of the `x-inbox-handler` header.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stage {
    /// Reading the delivery's properties: no `message_id`, one that is not a
    /// UUID, no `type`, a `content_type` that is not JSON.
    Decode,
    /// Delivered `queues[].delivery_limit` times without an outcome, on a
    /// queue whose broker does not limit deliveries: the runtime counted
    /// them (a message that crashes its consumer every time).
    DeliveryLimit,
    /// The body is larger than `failure.max_body_size` (checked by the
    /// consumer, which its header value names).
    BodySize,
    /// The body does not deserialize into the event.
    Deserialize,
    /// No handler is registered for the message's type: nothing to
    /// dispatch it to.
    NoHandler,
    /// Taking a connection from the pool.
    Database,
    /// `BEGIN`.
    Begin,
    /// Claiming the message in the inbox.
    InboxClaim,
    /// Recording the message in the inbox after its handlers.
    InboxRecord,
    /// Discarding the record of a message of a batch that failed alone.
    InboxAbandon,
    /// A batch's savepoint.
    Savepoint,
    /// Rolling a batch back to its savepoint.
    RollbackToSavepoint,
    /// Rolling back after a handler failed.
    Rollback,
    /// `COMMIT`.
    Commit,
    /// The whole transaction, past `database.transaction_timeout`.
    Transaction,
    /// Waiting for a turn to run a batch's handlers (a lane of
    /// `queues[].concurrent_batches`).
    BatchTurn,
    /// Calling the handlers: their host could not be reached (it stopped,
    /// or did not answer).
    HandlerCall,
    /// Handing the delivery over to the part of the runtime that runs its
    /// transaction, which could not be reached.
    Handover,
    /// The runtime itself (a panic outside the handlers).
    Runtime,
    /// A handler, by its [`EventHandler::name`](crate::EventHandler::name),
    /// of the event type it handles (a MassTransit message of several
    /// types runs the handlers of each: the type whose handler failed).
    Handler {
        /// Its name.
        name: &'static str,
        /// The event type it handled the message as.
        event_type: &'static str,
    },
}

impl Stage {
    /// Every runtime stage (all but [`Handler`](Self::Handler)), for docs
    /// and tests.
    pub const RUNTIME: [Stage; 19] = [
        Stage::Decode,
        Stage::DeliveryLimit,
        Stage::BodySize,
        Stage::Deserialize,
        Stage::NoHandler,
        Stage::Database,
        Stage::Begin,
        Stage::InboxClaim,
        Stage::InboxRecord,
        Stage::InboxAbandon,
        Stage::Savepoint,
        Stage::RollbackToSavepoint,
        Stage::Rollback,
        Stage::Commit,
        Stage::Transaction,
        Stage::BatchTurn,
        Stage::HandlerCall,
        Stage::Handover,
        Stage::Runtime,
    ];
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Decode => "decode",
            Stage::DeliveryLimit => "delivery limit",
            // Header values are read by operators' tools: kept as written.
            Stage::BodySize => "consumer",
            Stage::Deserialize => "deserialize",
            Stage::NoHandler => "dispatch",
            Stage::Database => "database",
            Stage::Begin => "begin",
            Stage::InboxClaim => "inbox claim",
            Stage::InboxRecord => "inbox record",
            Stage::InboxAbandon => "inbox abandon",
            Stage::Savepoint => "savepoint",
            Stage::RollbackToSavepoint => "rollback to savepoint",
            Stage::Rollback => "rollback",
            Stage::Commit => "commit",
            Stage::Transaction => "transaction",
            // The actors (`actors/`) that these stages reach.
            Stage::BatchTurn => "batch lane",
            Stage::HandlerCall => "handler actor",
            Stage::Handover => "dedup actor",
            Stage::Runtime => "runtime",
            Stage::Handler { name, .. } => name,
        })
    }
}

/// How one attempt at a message ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The handlers ran and their writes committed with the inbox row.
    Completed,
    /// Processed before: the handlers were skipped.
    Duplicate,
    /// Not processed, nothing committed; a later attempt may succeed (a
    /// handler failed or panicked, the database failed).
    Abandoned(Abandoned),
    /// Can never be processed as it is: malformed, or refused by a handler
    /// with a [`Permanent`](crate::Permanent) failure.
    Rejected {
        /// Where.
        stage: Stage,
        /// Why.
        reason: String,
    },
    /// No handler is registered for the message's type.
    NoHandler {
        /// The type.
        event_type: String,
    },
}

/// Why an attempt was abandoned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandoned {
    /// Where it failed.
    pub stage: Stage,
    /// The error, as text.
    pub reason: String,
    /// The database, not the message, failed (the runtime's own connection
    /// or pool): the message is held until the database answers, spending
    /// none of its attempts.
    pub unavailable: bool,
}

impl Abandoned {
    /// A failure of the message's own (a handler's, or the runtime's with it).
    pub fn new(stage: Stage, reason: impl ToString) -> Self {
        Self {
            stage,
            reason: reason.to_string(),
            unavailable: false,
        }
    }

    /// A failure of the runtime's own database work, classified (see
    /// [`is_unavailable`](crate::error::is_unavailable)), in PostgreSQL's own
    /// words from the error's sources.
    pub fn database(stage: Stage, error: &crate::Error) -> Self {
        Self {
            stage,
            reason: crate::error::describe(error),
            unavailable: error.is_unavailable(),
        }
    }
}

/// What to do with a delivery after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Ack it: its effects are committed (or were, by an earlier copy).
    Ack {
        /// It was a duplicate.
        duplicate: bool,
    },
    /// Keep it unacked until the database answers, then try again. Spends
    /// none of its attempts.
    Hold {
        /// The failure that says the database is away, for the log.
        reason: String,
    },
    /// Try again in process, in a fresh transaction, after a pause.
    Retry {
        /// The pause.
        after: Duration,
        /// The failure, and the history that now includes it.
        failure: Failure,
    },
    /// Publish a copy to `to`, stamped with the failure, then ack it.
    Move {
        /// Where.
        to: Target,
        /// Why, and the history to stamp.
        failure: Failure,
    },
}

/// A failure to act on, and the message's history including it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// Where.
    pub stage: Stage,
    /// Why.
    pub reason: String,
    /// The history to carry on.
    pub history: FailureHistory,
}

/// Where a message goes once its immediate retries are spent, given how
/// many delayed redeliveries it has had: the next retry tier, or `Q.error`
/// when every tier has been tried.
pub(crate) fn destination(failure: &FailureSettings, redeliveries: u32) -> Target {
    let next = usize::try_from(redeliveries).map_or(usize::MAX, |r| r.saturating_add(1));
    if next <= failure.delays.len() {
        Target::RetryTier(next)
    } else {
        Target::Exhausted
    }
}

/// Where a message moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// `Q.retry.<n>`, tiers counted from 1.
    RetryTier(usize),
    /// `Q.error`, after every attempt failed.
    Exhausted,
    /// `Q.error` at once: it can never succeed.
    Rejected,
    /// `Q.skipped`: no handler for its type.
    Skipped,
}

/// The failure policy. `history` is the message's, as its headers and this
/// delivery's attempts tell it; `failure` is `[failure]`.
///
/// - completed or duplicate: ack;
/// - abandoned because the database is away: hold, unless it was held
///   [`MAX_HOLDS_IN_VAIN`] times in a row while the database answered at
///   once (then it is the message's failure after all);
/// - abandoned: retry in process `failure.immediate_retries` times, with a
///   doubling backoff; then the next retry tier; after the last, `Q.error`;
/// - rejected (malformed, or a permanent failure): `Q.error` at once;
/// - no handler: `Q.skipped`.
pub(crate) fn decide(outcome: Outcome, history: &FailureHistory, failure: &FailureSettings) -> Action {
    let abandoned = match outcome {
        Outcome::Completed => return Action::Ack { duplicate: false },
        Outcome::Duplicate => return Action::Ack { duplicate: true },
        Outcome::Rejected { stage, reason } => {
            return Action::Move {
                to: Target::Rejected,
                failure: Failure {
                    stage,
                    reason,
                    history: history.clone(),
                },
            };
        }
        Outcome::NoHandler { event_type } => {
            return Action::Move {
                to: Target::Skipped,
                failure: Failure {
                    stage: Stage::NoHandler,
                    reason: format!("no handler registered for type `{event_type}`"),
                    history: history.clone(),
                },
            };
        }
        Outcome::Abandoned(abandoned) => abandoned,
    };
    if abandoned.unavailable && history.holds_in_vain < MAX_HOLDS_IN_VAIN {
        return Action::Hold {
            reason: abandoned.reason,
        };
    }
    let mut history = history.clone();
    history.record_failure();
    let retry = history.retries;
    if retry < failure.immediate_retries {
        history.retries += 1;
        return Action::Retry {
            after: failure.backoff(retry),
            failure: Failure {
                stage: abandoned.stage,
                reason: abandoned.reason,
                history,
            },
        };
    }
    let to = destination(failure, history.redeliveries);
    if let Target::RetryTier(_) = to {
        history.record_redelivery();
    }
    Action::Move {
        to,
        failure: Failure {
            stage: abandoned.stage,
            reason: abandoned.reason,
            history,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_failure_path_walks_the_tiers_then_the_error_queue() {
        let failure = FailureSettings::default();
        assert_eq!(destination(&failure, 0), Target::RetryTier(1));
        assert_eq!(destination(&failure, 2), Target::RetryTier(3));
        assert_eq!(destination(&failure, 3), Target::Exhausted);
    }

    fn failed(unavailable: bool) -> Outcome {
        Outcome::Abandoned(Abandoned {
            stage: Stage::Handler {
                name: "H",
                event_type: "E",
            },
            reason: "boom".into(),
            unavailable,
        })
    }

    fn history(attempts: u32, redeliveries: u32, retries: u32, holds_in_vain: u32) -> FailureHistory {
        FailureHistory {
            attempts,
            redeliveries,
            first_failure: None,
            retries,
            holds_in_vain,
        }
    }

    /// What an action comes to, without times: its kind, then attempts,
    /// redeliveries and retries of the history it carries on.
    type Shape<'a> = (&'a str, u32, u32, u32);

    fn shape(action: &Action) -> (String, u32, u32, u32) {
        let of = |f: &Failure| (f.history.attempts, f.history.redeliveries, f.history.retries);
        match action {
            Action::Ack { duplicate } => (format!("ack duplicate={duplicate}"), 0, 0, 0),
            Action::Hold { .. } => ("hold".into(), 0, 0, 0),
            Action::Retry { after, failure } => {
                let (a, r, t) = of(failure);
                (format!("retry after {after:?}"), a, r, t)
            }
            Action::Move { to, failure } => {
                let (a, r, t) = of(failure);
                (format!("move {to:?}"), a, r, t)
            }
        }
    }

    #[test]
    fn every_path_of_the_failure_policy() {
        // The defaults: 3 immediate retries from 100 ms, tiers 30s, 5m, 1h.
        let settings = FailureSettings::default();
        let permanent = Outcome::Rejected {
            stage: Stage::Handler {
                name: "H",
                event_type: "E",
            },
            reason: "banned".into(),
        };
        let malformed = Outcome::Rejected {
            stage: Stage::Decode,
            reason: "no type".into(),
        };
        let no_handler = Outcome::NoHandler {
            event_type: "T".into(),
        };
        // (path, outcome, history before, what the action comes to)
        let table: Vec<(&str, Outcome, FailureHistory, Shape<'_>)> = vec![
            (
                "completed",
                Outcome::Completed,
                history(0, 0, 0, 0),
                ("ack duplicate=false", 0, 0, 0),
            ),
            (
                "duplicate",
                Outcome::Duplicate,
                history(5, 1, 0, 0),
                ("ack duplicate=true", 0, 0, 0),
            ),
            (
                "first failure",
                failed(false),
                history(0, 0, 0, 0),
                ("retry after 100ms", 1, 0, 1),
            ),
            (
                "second failure",
                failed(false),
                history(1, 0, 1, 0),
                ("retry after 200ms", 2, 0, 2),
            ),
            (
                "third failure",
                failed(false),
                history(2, 0, 2, 0),
                ("retry after 400ms", 3, 0, 3),
            ),
            (
                "retries spent: first tier",
                failed(false),
                history(3, 0, 3, 0),
                ("move RetryTier(1)", 4, 1, 3),
            ),
            (
                "back from a tier: retries again",
                failed(false),
                history(4, 1, 0, 0),
                ("retry after 100ms", 5, 1, 1),
            ),
            (
                "second tier",
                failed(false),
                history(7, 1, 3, 0),
                ("move RetryTier(2)", 8, 2, 3),
            ),
            (
                "last tier",
                failed(false),
                history(11, 2, 3, 0),
                ("move RetryTier(3)", 12, 3, 3),
            ),
            (
                "every tier passed: the error queue",
                failed(false),
                history(15, 3, 3, 0),
                ("move Exhausted", 16, 3, 3),
            ),
            (
                "a history past every limit (untrusted headers)",
                failed(false),
                history(u32::MAX, u32::MAX, 3, 0),
                ("move Exhausted", u32::MAX, u32::MAX, 3),
            ),
            (
                "database away: hold",
                failed(true),
                history(2, 1, 1, 0),
                ("hold", 0, 0, 0),
            ),
            (
                "database away, held in vain twice: hold",
                failed(true),
                history(2, 1, 1, 2),
                ("hold", 0, 0, 0),
            ),
            (
                "held in vain three times: an attempt",
                failed(true),
                history(2, 1, 1, 3),
                ("retry after 200ms", 3, 1, 2),
            ),
            (
                "permanent: the error queue at once",
                permanent,
                history(1, 0, 1, 0),
                ("move Rejected", 1, 0, 1),
            ),
            (
                "malformed: the error queue at once",
                malformed,
                history(0, 0, 0, 0),
                ("move Rejected", 0, 0, 0),
            ),
            (
                "no handler: the skipped queue",
                no_handler,
                history(3, 1, 0, 0),
                ("move Skipped", 3, 1, 0),
            ),
        ];
        for (path, outcome, history, (kind, attempts, redeliveries, retries)) in table {
            let action = decide(outcome, &history, &settings);
            assert_eq!(
                shape(&action),
                (kind.to_owned(), attempts, redeliveries, retries),
                "{path}"
            );
        }
    }

    #[test]
    fn the_header_table_names_every_runtime_stage() {
        let doc = include_str!("../../docs/failure-policy.md");
        let row = doc
            .lines()
            .find(|line| line.starts_with("| `x-inbox-handler` |"))
            .expect("docs/failure-policy.md has the x-inbox-handler row");
        let named: std::collections::BTreeSet<&str> = row
            .split('`')
            .skip(1)
            .step_by(2) // what stands between backticks
            .filter(|code| !["x-inbox-handler", "EventHandler::name"].contains(code))
            .collect();
        let stages: std::collections::BTreeSet<String> =
            Stage::RUNTIME.iter().map(|stage| stage.to_string()).collect();
        let stages: std::collections::BTreeSet<&str> = stages.iter().map(String::as_str).collect();
        assert_eq!(named, stages);
    }

    #[test]
    fn no_tiers_and_no_retries_go_straight_to_the_error_queue() {
        let settings = FailureSettings {
            immediate_retries: 0,
            delays: Vec::new(),
            ..FailureSettings::default()
        };
        let action = decide(failed(false), &FailureHistory::default(), &settings);
        assert_eq!(shape(&action), ("move Exhausted".to_owned(), 1, 0, 0));
    }

    #[test]
    fn a_failure_keeps_its_stage_reason_and_first_failure_time() {
        let action = decide(
            failed(false),
            &FailureHistory::default(),
            &FailureSettings::default(),
        );
        let Action::Retry { failure, .. } = action else {
            panic!("{action:?}")
        };
        assert_eq!(
            (failure.stage.to_string().as_str(), failure.reason.as_str()),
            ("H", "boom")
        );
        assert!(failure.history.first_failure.is_some());
    }
}
