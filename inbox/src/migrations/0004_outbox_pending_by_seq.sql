-- The dispatcher claims pending rows in staging order, nearly all of them
-- due: an index in seq order lets it read the first batch_size of them
-- instead of sorting every due row each round.
DROP INDEX IF EXISTS outbox_messages_due;
CREATE INDEX IF NOT EXISTS outbox_messages_pending ON outbox_messages (seq) WHERE dead_at IS NULL;
