-- A round leases the rows it claims by moving their next_attempt_at (no
-- transaction stays open across a publish). That column is in no index, so
-- the update can stay on its page without touching an index (a HOT update)
-- if the page has room: leave half of each page free for it.
ALTER TABLE outbox_messages SET (fillfactor = 50);
