#!/usr/bin/env bash
# The fault suite (docs/guarantees.md, "Under failure"): runs the check-in
# service while SIGKILLing it, force-closing its AMQP connection and
# restarting PostgreSQL and RabbitMQ, then checks that nothing was lost or
# applied twice. It restarts this machine's PostgreSQL and RabbitMQ: run it
# where nothing else uses them. A few minutes at most.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --example checkin_service
cargo test --quiet --test fault_suite --no-run
suite() { timeout 300 cargo test --quiet --test fault_suite -- "$@"; }
# One message per transaction, then batches of up to 8; then both again
# with the service and the suite speaking MassTransit's wire.
suite
suite --batch-size 8
suite --wire masstransit
suite --wire masstransit --batch-size 8
# Once more on an endpoint MassTransit declared first: classic queues
# without a delivery limit, taken over as they are.
suite --wire masstransit --masstransit-endpoint
