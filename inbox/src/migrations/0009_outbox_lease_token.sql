-- The round that holds a row's lease, by a token of its own: a renewal or a
-- settle matches the token, not the lease's end, so a renewal that committed
-- but whose answer was lost does not leave the round unable to renew again.
-- In no index, like next_attempt_at: the renewals stay HOT updates.
ALTER TABLE outbox_messages ADD COLUMN IF NOT EXISTS lease uuid;
