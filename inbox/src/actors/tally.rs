//! What the runtime counts: each one a field of the stats and, for what
//! befalls a message, a series of its queue's metrics. Below both, so that
//! neither reads the other for it.

/// One thing the runtime counts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Tally {
    Completed,
    Duplicates,
    Abandoned,
    Retried,
    Rejected,
    Skipped,
    Delayed,
    DeadLettered,
    UnconfirmedAcks,
    Held,
    MovesHandedBack,
    Batches,
    BatchesSplit,
}
