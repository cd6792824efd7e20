-- When an operator last resumed a job: its self-pause weighs only what it
-- redrove since (a resumed job is not paused again for the failures the
-- operator resumed it over).
ALTER TABLE inbox_ops_jobs ADD COLUMN IF NOT EXISTS resumed_at timestamptz;
