#!/usr/bin/env bash
# The fault suite (docs/guarantees.md, "Under failure"): runs the check-in
# service while SIGKILLing it, force-closing its AMQP connection and
# restarting PostgreSQL and RabbitMQ, then checks that nothing was lost or
# applied twice. It restarts this machine's PostgreSQL and RabbitMQ (and
# the TLS servers of tests/tls_servers.sh): run it where nothing else uses
# them. A few minutes at most.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --example checkin_service
cargo test --quiet --test fault_suite --no-run
suite() { timeout 300 cargo test --quiet --test fault_suite -- "$@"; }
# One message per transaction, then batches of up to 8; then both again
# with the service and the suite speaking MassTransit's wire. The batched
# runs serve the operator plane (--ops): the error queue is drained into
# the failures table under the same kills, one row per failed message.
suite
suite --batch-size 8 --ops
suite --wire masstransit
suite --wire masstransit --batch-size 8 --ops
# Once more on an endpoint MassTransit declared first: classic queues
# without a delivery limit, taken over as they are.
suite --wire masstransit --masstransit-endpoint
# And on an endpoint the service declared first, declared again as
# MassTransit does while the service runs: the way back stays open.
suite --wire masstransit --masstransit-after
# Once more over TLS on both connections, verified: a PostgreSQL that takes
# TLS only and a RabbitMQ node with a TLS listener only.
bash tests/tls_servers.sh start
eval "$(bash tests/tls_servers.sh env)"
DATABASE_URL="postgres://postgres@localhost:$TLS_PG_PORT/postgres?sslmode=verify-full&sslrootcert=$TLS_CERTS/ca.pem" \
    AMQP_URL="amqps://guest:guest@localhost:$TLS_AMQP_PORT/%2f?cacertfile=$TLS_CERTS/ca.pem" \
    suite --tls
