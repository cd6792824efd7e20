#!/usr/bin/env bash
# A second PostgreSQL server on this machine, for the database failover test
# (tests/it/failover.rs): the cluster `failover` of the installed version, on
# port 5433 (FAILOVER_PG_PORT), trust auth on loopback like the main one.
#
#   tests/second_postgres.sh [start]   create it if missing, start it if down
#   tests/second_postgres.sh stop      stop it (its data stays, for next time)
#
# It never touches the machine's own cluster (`main`, port 5432).
set -euo pipefail
port=${FAILOVER_PG_PORT:-5433}
version=$(ls /etc/postgresql | sort -V | tail -n 1)

case "${1:-start}" in
start)
    if ! pg_lsclusters --no-header | awk -v v="$version" '$1 == v && $2 == "failover"' | grep -q .; then
        pg_createcluster "$version" failover --port "$port" -- --auth-local=trust --auth-host=trust >/dev/null
    fi
    if ! pg_isready -h 127.0.0.1 -p "$port" -q; then
        pg_ctlcluster --skip-systemctl-redirect "$version" failover start
    fi
    for _ in $(seq 30); do
        pg_isready -h 127.0.0.1 -p "$port" -q && exit 0
        sleep 1
    done
    echo "second_postgres: the cluster 'failover' did not come up on port $port" >&2
    exit 1
    ;;
stop)
    pg_ctlcluster --skip-systemctl-redirect "$version" failover stop 2>/dev/null || true
    ;;
*)
    echo "usage: $0 [start|stop]" >&2
    exit 2
    ;;
esac
