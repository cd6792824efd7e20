-- A runtime that dispatches its own outbox wakes its dispatcher in process
-- when a commit staged rows, and connects with `inbox.outbox_notify=off`:
-- its commits skip the NOTIFY, which costs every notifying commit a
-- database-wide lock held through its flush to disk (commits that notify
-- go one at a time). Every other session (another service, a script,
-- psql) notifies as before.
CREATE OR REPLACE FUNCTION inbox_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('inbox.outbox_notify', true), '') <> 'off' THEN
        PERFORM pg_notify('inbox_outbox', '');
    END IF;
    RETURN NULL;
END;
$$;
