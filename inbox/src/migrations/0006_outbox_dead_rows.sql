-- Dead rows, few and parked, found without a scan of the whole table: for
-- the dispatcher's backlog sample every poll interval, the sweeper and
-- the retry of dead rows.
CREATE INDEX IF NOT EXISTS outbox_messages_dead ON outbox_messages (seq) WHERE dead_at IS NOT NULL;
