-- The operator plane: what an operator does with the failures in
-- inbox_failures (redrive, discard, restore, pause a queue), each action
-- one transaction with its audit row.

-- A redriven failure is staged as an outbox row that carries the AMQP
-- properties it was set aside with (its content type, correlation id,
-- typed headers...), which the dispatcher publishes as they are. NULL for
-- every row a handler staged: those get the wire's properties.
ALTER TABLE outbox_messages ADD COLUMN IF NOT EXISTS properties jsonb;

-- Which job claimed the failure (kept after: a redriven message that fails
-- again counts against its job), when it was staged, and why it was
-- discarded.
ALTER TABLE inbox_failures ADD COLUMN IF NOT EXISTS job_id uuid;
ALTER TABLE inbox_failures ADD COLUMN IF NOT EXISTS redriven_at timestamptz;
ALTER TABLE inbox_failures ADD COLUMN IF NOT EXISTS discard_reason text;
CREATE INDEX IF NOT EXISTS inbox_failures_by_job ON inbox_failures (job_id, status) WHERE job_id IS NOT NULL;
-- The list's keyset order (newest failure first, then id).
CREATE INDEX IF NOT EXISTS inbox_failures_by_last_failure ON inbox_failures (last_failed_at DESC, id DESC);
-- Retention finds resolved failures by their last change.
CREATE INDEX IF NOT EXISTS inbox_failures_by_update ON inbox_failures (updated_at);

-- An action on a selection of failures. A redrive runs as a job that any
-- instance advances, a slice at a time, at its rate; a discard or a
-- restore is done when it is created. Its state is here, so that a job
-- goes on after a restart of any instance.
CREATE TABLE IF NOT EXISTS inbox_ops_jobs (
    id              uuid        PRIMARY KEY,
    -- redrive | discard | restore
    action          text        NOT NULL,
    -- running | paused | cancelled | done
    status          text        NOT NULL,
    -- Who started it (a token's name).
    actor           text        NOT NULL,
    reason          text,
    -- {"ids": [...]} or {"filter": {...}}, as asked.
    selection       jsonb       NOT NULL,
    rate_per_second integer,
    total           integer     NOT NULL,
    done            integer     NOT NULL DEFAULT 0,
    -- Why it paused itself (its redriven messages failed again).
    paused_reason   text,
    -- The earliest time its next message may be staged: its rate, kept
    -- across instances and restarts.
    next_at         timestamptz NOT NULL DEFAULT now(),
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS inbox_ops_jobs_running ON inbox_ops_jobs (next_at) WHERE status = 'running';

-- Who did what, when, to which messages, and why. Append-only: the
-- trigger below refuses every change but an insert.
CREATE TABLE IF NOT EXISTS inbox_ops_audit (
    seq      bigserial   PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text        NOT NULL,
    role     text        NOT NULL,
    -- redrive | discard | restore | pause_job | resume_job | cancel_job |
    -- pause_queue | resume_queue
    action   text        NOT NULL,
    -- {"ids": [...]}, {"filter": {...}}, {"job": id} or {"queue": name}
    target   jsonb       NOT NULL,
    reason   text,
    -- How many messages it took (a redrive: how many it claimed).
    affected integer     NOT NULL DEFAULT 0,
    job_id   uuid
);

CREATE OR REPLACE FUNCTION inbox_ops_audit_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'inbox_ops_audit is append-only: % refused', TG_OP;
END;
$$;

DROP TRIGGER IF EXISTS inbox_ops_audit_append_only ON inbox_ops_audit;
CREATE TRIGGER inbox_ops_audit_append_only
    BEFORE UPDATE OR DELETE ON inbox_ops_audit
    FOR EACH ROW EXECUTE FUNCTION inbox_ops_audit_append_only();
DROP TRIGGER IF EXISTS inbox_ops_audit_no_truncate ON inbox_ops_audit;
CREATE TRIGGER inbox_ops_audit_no_truncate
    BEFORE TRUNCATE ON inbox_ops_audit
    FOR EACH STATEMENT EXECUTE FUNCTION inbox_ops_audit_append_only();

-- Queues an operator paused: every instance stops consuming them while
-- their row is here, a restarted one too.
CREATE TABLE IF NOT EXISTS inbox_ops_paused_queues (
    queue     text        PRIMARY KEY,
    paused_by text        NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT now(),
    reason    text
);
