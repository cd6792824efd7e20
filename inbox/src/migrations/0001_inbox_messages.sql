-- One row per processed message, per consumer: the dedup record.
CREATE TABLE IF NOT EXISTS inbox_messages (
    consumer     text        NOT NULL,
    message_id   uuid        NOT NULL,
    event_type   text        NOT NULL,
    processed_at timestamptz NOT NULL,
    PRIMARY KEY (consumer, message_id)
);

-- Retention deletes by age.
CREATE INDEX IF NOT EXISTS inbox_messages_processed_at ON inbox_messages (processed_at);
