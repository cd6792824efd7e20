#!/usr/bin/env bash
# A three-node RabbitMQ cluster on this machine, for the node-loss fault run
# (docs/guarantees.md, "Under failure"): two more nodes of the installed
# RabbitMQ, rabbit2@localhost and rabbit3@localhost (AMQP on 5673 and 5674,
# each with its own data under /tmp/inbox-cluster), joined to the machine's
# own node. `down` stops them and makes the machine's node forget them:
# it is left a standalone node again, its users and settings untouched.
#
#   tests/cluster.sh up        start the two nodes and join them
#   tests/cluster.sh down      stop them, forget them, remove their data
#   tests/cluster.sh run       up, the fault suite's node-loss run, down
#   tests/cluster.sh kill N    SIGKILL node N (2 or 3), as a crash would
#   tests/cluster.sh start N   start node N again (it rejoins by itself)
#
# The fault run kills only the two added nodes: the service and the suite
# connect to those (message_bus.amqp_urls), so the queues' leaders start
# there, and the machine's own node keeps the quorum while one is down.
# Run it as root, where nothing else uses this RabbitMQ: two to three
# minutes, up to about seven when a kill cuts a retry tier's dead-lettering
# (RabbitMQ re-sends after its three-minute dead-letter confirm timeout).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=/tmp/inbox-cluster
MAIN=rabbit@localhost
NODES=(2 3)

node() { echo "rabbit$1@localhost"; }
port() { echo $((5671 + $1)); }
ctl() { rabbitmqctl -q "$@"; }

start_node() {
    local n=$1 dir=$BASE/rabbit$1
    mkdir -p "$dir/mnesia" "$dir/log"
    cat >"$dir/rabbitmq-env.conf" <<CONF
NODENAME=$(node "$n")
NODE_PORT=$(port "$n")
DIST_PORT=$(($(port "$n") + 20000))
CONFIG_FILE=$dir/rabbitmq.conf
MNESIA_BASE=$dir/mnesia
LOG_BASE=$dir/log
PID_FILE=$dir/pid
ENABLED_PLUGINS_FILE=$dir/enabled_plugins
ERL_EPMD_ADDRESS=127.0.0.1
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
CONF
    echo "listeners.tcp.local = 127.0.0.1:$(port "$n")" >"$dir/rabbitmq.conf"
    echo "[]." >"$dir/enabled_plugins"
    chown -R rabbitmq:rabbitmq "$BASE"
    (cd /var/lib/rabbitmq && runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq \
        RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf" \
        /usr/lib/rabbitmq/bin/rabbitmq-server -detached >"$dir/log/detached.log" 2>&1)
    for _ in $(seq 120); do
        ctl -n "$(node "$n")" await_startup >/dev/null 2>&1 && return 0
        sleep 1
    done
    echo "cluster: $(node "$n") did not start; see $dir/log" >&2
    return 1
}

kill_node() {
    local pid
    pid=$(cat "$BASE/rabbit$1/pid" 2>/dev/null || true)
    if [[ -n $pid ]]; then
        kill -KILL "$pid" 2>/dev/null || true
    fi
}

up() {
    ctl await_startup
    for n in "${NODES[@]}"; do
        if ctl -n "$(node "$n")" await_startup >/dev/null 2>&1; then
            continue
        fi
        start_node "$n"
        # Joining logs feature-flag warnings that mean nothing here.
        {
            ctl -n "$(node "$n")" stop_app
            ctl -n "$(node "$n")" reset
            ctl -n "$(node "$n")" join_cluster "$MAIN"
            ctl -n "$(node "$n")" start_app
            ctl -n "$(node "$n")" await_startup
        } >"$BASE/rabbit$n/log/join.log" 2>&1 || {
            cat "$BASE/rabbit$n/log/join.log" >&2
            exit 1
        }
    done
    echo "cluster: $(ctl cluster_status --formatter json | tr -d '\n' | grep -o '"running_nodes":\[[^]]*\]')"
}

down() {
    for n in "${NODES[@]}"; do
        ctl -n "$(node "$n")" stop >/dev/null 2>&1 || kill_node "$n"
    done
    for n in "${NODES[@]}"; do
        ctl forget_cluster_node "$(node "$n")" >/dev/null 2>&1 || true
    done
    rm -rf "$BASE"
    echo "cluster: $MAIN is standalone again: $(ctl cluster_status --formatter json | tr -d '\n' | grep -o '"disk_nodes":\[[^]]*\]')"
}

case "${1:-run}" in
up) up ;;
down) down ;;
kill) kill_node "$2" ;;
start) start_node "$2" ;;
run)
    trap down EXIT
    up
    cargo build --quiet --example checkin_service
    cargo test --quiet --test fault_suite --no-run
    urls="amqp://guest:guest@127.0.0.1:$(port 2)/%2f,amqp://guest:guest@127.0.0.1:$(port 3)/%2f"
    CLUSTER_AMQP_URLS=$urls timeout 900 cargo test --quiet --test fault_suite -- --cluster
    ;;
*)
    echo "usage: $0 [up|down|run|kill N|start N]" >&2
    exit 2
    ;;
esac
