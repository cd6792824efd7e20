-- Failed messages, out of the broker: one row per message and source queue,
-- ingested from Q.error and Q.skipped (Q_error, Q_skipped) by the failures
-- drainer (failures.drain), so that an operator can see, group, redrive and
-- discard them without taking anything off a queue. A row is written and
-- committed before its copy is acked: a crash in between ingests it again,
-- into the same row.
CREATE TABLE IF NOT EXISTS inbox_failures (
    id               uuid        PRIMARY KEY,
    -- The queue it failed on, and the key of the message there: its
    -- message_id, or, for one without a valid id (malformed), a hash of its
    -- body.
    queue            text        NOT NULL,
    message_key      text        NOT NULL,
    message_id       uuid,
    -- error | skipped | dead_outbox
    kind             text        NOT NULL,
    -- The queue it was set aside in (Q.error, Q_skipped...).
    set_aside_in     text        NOT NULL,
    message_type     text,
    -- Its AMQP properties and headers (JSON), and body, as set aside.
    properties       jsonb       NOT NULL,
    headers          jsonb       NOT NULL,
    body             bytea       NOT NULL,
    reason           text,
    handler          text,
    attempts         integer     NOT NULL DEFAULT 0,
    -- Groups the same cause across messages: type, handler and reason with
    -- its numbers and ids blanked.
    fingerprint      text        NOT NULL,
    first_failed_at  timestamptz NOT NULL,
    last_failed_at   timestamptz NOT NULL,
    -- How many times it was set aside (a redriven message that fails again
    -- comes back to its row).
    times_failed     integer     NOT NULL DEFAULT 1,
    -- open | redriving | redriven | discarded
    status           text        NOT NULL DEFAULT 'open',
    updated_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (queue, message_key)
);

CREATE INDEX IF NOT EXISTS inbox_failures_by_status ON inbox_failures (status, queue, last_failed_at);
CREATE INDEX IF NOT EXISTS inbox_failures_open_by_fingerprint ON inbox_failures (fingerprint) WHERE status = 'open';
