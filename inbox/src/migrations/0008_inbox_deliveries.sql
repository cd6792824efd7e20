-- Deliveries of a message that the broker marked redelivered, on a queue
-- whose broker does not limit them (a classic queue, or one another client
-- declared): counted in a statement of its own, committed before the
-- handlers run, so a message that crashes the consumer every time is still
-- counted, and set aside once it reaches queues[].delivery_limit. Only
-- redeliveries write here; retention sweeps the rows.
CREATE TABLE IF NOT EXISTS inbox_deliveries (
    consumer          text        NOT NULL,
    message_id        uuid        NOT NULL,
    deliveries        integer     NOT NULL,
    last_delivered_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
