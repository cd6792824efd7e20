-- Every statement that stages outbox rows notifies `inbox_outbox` when its
-- transaction commits (never for a rollback; PostgreSQL folds the
-- notifications of one transaction into one), so that a dispatcher of any
-- process wakes at once, whoever staged the rows.
CREATE OR REPLACE FUNCTION inbox_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('inbox_outbox', '');
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS outbox_messages_notify ON outbox_messages;
CREATE TRIGGER outbox_messages_notify
    AFTER INSERT ON outbox_messages
    FOR EACH STATEMENT EXECUTE FUNCTION inbox_outbox_notify();
