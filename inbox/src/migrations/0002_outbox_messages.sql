-- One row per message staged for publishing, written in the transaction
-- that staged it and deleted once the broker has confirmed it.
CREATE TABLE IF NOT EXISTS outbox_messages (
    seq             bigserial   PRIMARY KEY,
    message_id      uuid        NOT NULL UNIQUE,
    exchange        text        NOT NULL,
    routing_key     text        NOT NULL,
    message_type    text        NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}',
    body            bytea       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    -- Set once the row has failed outbox.max_attempts times: parked, never
    -- dispatched again unless replayed.
    dead_at         timestamptz
);

-- The dispatcher claims due rows in staging order.
CREATE INDEX IF NOT EXISTS outbox_messages_due ON outbox_messages (next_attempt_at, seq)
    WHERE dead_at IS NULL;
