#!/usr/bin/env bash
# TLS servers on this machine, beside its own, for the TLS integration tests:
# a test CA and its certificates under /tmp/inbox-tls/certs (TLS_CERTS), two
# more PostgreSQL clusters of the installed version, `tls` on port 5434
# (TLS_PG_PORT: TLS only, user tls_client by client certificate, every other
# user trusted) and `tls_expired` on port 5435 (TLS_EXPIRED_PG_PORT: an
# expired server certificate), and a standalone RabbitMQ node
# rabbit_tls@localhost, AMQP over TLS only on port 5671 (TLS_AMQP_PORT),
# with the EXTERNAL mechanism for user tls_client (its data under
# /tmp/inbox-tls/rabbit).
#
#   tests/tls_servers.sh [start]            create what is missing, start what is down
#   tests/tls_servers.sh stop               stop the three servers (files stay, for next time)
#   tests/tls_servers.sh env                the KEY=value lines the tests read
#   tests/tls_servers.sh restart-postgres   stop and start the cluster `tls`
#   tests/tls_servers.sh restart-rabbitmq   stop_app and start_app on rabbit_tls@localhost
#
# The certificates: ca.pem/ca.key (CN "inbox test CA"), other-ca.pem (an
# unrelated CA), server.pem/server.key (CN and SAN DNS:localhost only, no IP
# SAN), expired.pem/expired.key (the same, valid 2020-2021 only) and
# client.pem/client.key (CN tls_client, clientAuth), RSA 2048, keys in
# unencrypted PKCS#8 PEM. All are made again when one is missing; the
# servers get their own copies, owned by their users.
#
# It never touches the machine's own cluster (`main`, port 5432) nor its
# RabbitMQ node (rabbit@localhost, port 5672). Run it as root.
set -euo pipefail

TOP=/tmp/inbox-tls
CERTS=$TOP/certs
RDIR=$TOP/rabbit
NODE=rabbit_tls@localhost
DIST_PORT=25675
pg_port=${TLS_PG_PORT:-5434}
expired_port=${TLS_EXPIRED_PG_PORT:-5435}
amqp_port=${TLS_AMQP_PORT:-5671}
# shellcheck disable=SC2012 # version directories: plain names
version=$(ls /etc/postgresql | sort -V | tail -n 1)
CERT_FILES=(ca.pem ca.key other-ca.pem other-ca.key server.pem server.key
    expired.pem expired.key client.pem client.key)

rctl() { rabbitmqctl -q -n "$NODE" "$@"; }
# The servers must not inherit fd 9, the lock of this script (see the end).
pgctl() { pg_ctlcluster --skip-systemctl-redirect "$version" "$@" 9>&-; }

# put DEST OWNER MODE < content: installs the content as DEST when it differs
# from what is there, and then sets `changed`.
put() {
    local dest=$1 owner=$2 mode=$3 tmp
    tmp=$(mktemp)
    cat >"$tmp"
    if [[ -f $dest ]] && cmp -s "$tmp" "$dest"; then
        rm -f "$tmp"
        return 0
    fi
    install -o "$owner" -g "$owner" -m "$mode" "$tmp" "$dest"
    rm -f "$tmp"
    changed=1
}

certs() {
    local f work
    for f in "${CERT_FILES[@]}"; do
        [[ -f $CERTS/$f ]] || break
    done
    [[ -f $CERTS/$f ]] && return 0
    work=$(mktemp -d)
    cat >"$work/openssl.cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[ca]
default_ca = test_ca
[test_ca]
database = $work/index.txt
new_certs_dir = $work
serial = $work/serial
default_md = sha256
policy = policy_cn
unique_subject = no
email_in_dn = no
copy_extensions = none
[policy_cn]
commonName = supplied
[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
[client_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
CNF
    : >"$work/index.txt"
    openssl rand -hex 16 >"$work/serial"
    for f in ca other-ca server expired client; do
        openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$work/$f.key" 2>/dev/null
    done
    openssl req -x509 -new -config "$work/openssl.cnf" -extensions ca_ext -sha256 -days 3650 \
        -key "$work/ca.key" -subj "/CN=inbox test CA" -out "$work/ca.pem"
    openssl req -x509 -new -config "$work/openssl.cnf" -extensions ca_ext -sha256 -days 3650 \
        -key "$work/other-ca.key" -subj "/CN=inbox other test CA" -out "$work/other-ca.pem"
    # sign NAME CN EXTENSIONS DATES...: NAME.pem from NAME.key, by the test CA.
    sign() {
        openssl req -new -config "$work/openssl.cnf" -key "$work/$1.key" -subj "/CN=$2" -out "$work/$1.csr"
        openssl ca -config "$work/openssl.cnf" -batch -notext -rand_serial -cert "$work/ca.pem" \
            -keyfile "$work/ca.key" -extensions "$3" -in "$work/$1.csr" -out "$work/$1.pem" "${@:4}" 2>/dev/null
    }
    sign server localhost server_ext -days 3650
    sign expired localhost server_ext -startdate 200101000000Z -enddate 210101000000Z
    sign client tls_client client_ext -days 3650
    mkdir -p "$CERTS"
    chmod 0755 "$CERTS"
    for f in "${CERT_FILES[@]}"; do
        if [[ $f == *.key ]]; then
            install -m 0600 "$work/$f" "$CERTS/$f"
        else
            install -m 0644 "$work/$f" "$CERTS/$f"
        fi
    done
    rm -rf "$work"
    echo "tls_servers: made the certificates in $CERTS"
}

pg_wait() {
    for _ in $(seq 30); do
        pg_isready -h 127.0.0.1 -p "$1" -q && return 0
        sleep 1
    done
    echo "tls_servers: the cluster '$2' did not come up on port $1;" \
        "see /var/log/postgresql/postgresql-$version-$2.log" >&2
    return 1
}

# pg_up NAME PORT CERT HBA: the cluster NAME on PORT, serving CERT.pem/CERT.key.
pg_up() {
    local name=$1 port=$2 cert=$3 hba=$4 conf=/etc/postgresql/$version/$1
    changed=
    if ! pg_lsclusters --no-header | awk -v v="$version" -v c="$name" '$1 == v && $2 == c' | grep -q .; then
        pg_createcluster "$version" "$name" --port "$port" -- --auth-local=trust --auth-host=trust >/dev/null
    fi
    mkdir -p "$conf/conf.d"
    put "$conf/tls-cert.pem" postgres 0644 <"$CERTS/$cert.pem"
    put "$conf/tls-key.pem" postgres 0600 <"$CERTS/$cert.key"
    put "$conf/tls-ca.pem" postgres 0644 <"$CERTS/ca.pem"
    put "$conf/conf.d/90-inbox-tls.conf" postgres 0644 <<CONF
# Written by tests/tls_servers.sh.
listen_addresses = '127.0.0.1,::1'
ssl = on
ssl_cert_file = '$conf/tls-cert.pem'
ssl_key_file = '$conf/tls-key.pem'
ssl_ca_file = '$conf/tls-ca.pem'
CONF
    put "$conf/pg_hba.conf" postgres 0640 <<<"$hba"
    if pgctl "$name" status >/dev/null 2>&1; then
        if [[ -n $changed ]]; then
            pgctl "$name" restart
        fi
    else
        pgctl "$name" start
    fi
    pg_wait "$port" "$name"
}

postgres_up() {
    pg_up tls "$pg_port" server "# Written by tests/tls_servers.sh: TLS only on TCP.
local   all all                       trust
hostssl all tls_client 127.0.0.1/32   cert
hostssl all tls_client ::1/128        cert
hostssl all all        127.0.0.1/32   trust
hostssl all all        ::1/128        trust"
    psql -h /var/run/postgresql -p "$pg_port" -U postgres -d postgres -qAtX -v ON_ERROR_STOP=1 -c \
        "DO \$\$ BEGIN
             IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'tls_client') THEN
                 CREATE ROLE tls_client LOGIN SUPERUSER;
             END IF;
         END \$\$"
    pg_up tls_expired "$expired_port" expired "# Written by tests/tls_servers.sh: TLS only on TCP.
local   all all                       trust
hostssl all all        127.0.0.1/32   trust
hostssl all all        ::1/128        trust"
}

rabbit_files() {
    changed=
    mkdir -p "$RDIR/mnesia" "$RDIR/log"
    chown rabbitmq:rabbitmq "$RDIR" "$RDIR/mnesia" "$RDIR/log"
    put "$RDIR/rabbitmq-env.conf" rabbitmq 0644 <<CONF
NODENAME=$NODE
DIST_PORT=$DIST_PORT
CONFIG_FILE=$RDIR/rabbitmq.conf
MNESIA_BASE=$RDIR/mnesia
LOG_BASE=$RDIR/log
PID_FILE=$RDIR/pid
ENABLED_PLUGINS_FILE=$RDIR/enabled_plugins
ERL_EPMD_ADDRESS=127.0.0.1
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
CONF
    put "$RDIR/rabbitmq.conf" rabbitmq 0644 <<CONF
listeners.tcp = none
listeners.ssl.default = $amqp_port
ssl_options.cacertfile = $RDIR/ca.pem
ssl_options.certfile = $RDIR/server.pem
ssl_options.keyfile = $RDIR/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
CONF
    put "$RDIR/enabled_plugins" rabbitmq 0644 <<<"[rabbitmq_auth_mechanism_ssl]."
    put "$RDIR/ca.pem" rabbitmq 0644 <"$CERTS/ca.pem"
    put "$RDIR/server.pem" rabbitmq 0644 <"$CERTS/server.pem"
    put "$RDIR/server.key" rabbitmq 0600 <"$CERTS/server.key"
}

rabbit_spawn() {
    (cd /var/lib/rabbitmq && runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq \
        RABBITMQ_CONF_ENV_FILE="$RDIR/rabbitmq-env.conf" \
        /usr/lib/rabbitmq/bin/rabbitmq-server -detached >"$RDIR/log/detached.log" 2>&1 9>&-)
}

rabbit_wait() {
    for _ in $(seq 120); do
        rctl await_startup >/dev/null 2>&1 && return 0
        sleep 1
    done
    echo "tls_servers: $NODE did not start; see $RDIR/log/$NODE.log" >&2
    return 1
}

# The node's OS process id, when its pid file names a live process of this node.
rabbit_pid() {
    local pid
    pid=$(cat "$RDIR/pid" 2>/dev/null || true)
    if [[ -n $pid ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$NODE"; then
        echo "$pid"
    fi
}

rabbit_stop() {
    local pid
    pid=$(rabbit_pid)
    rctl stop >/dev/null 2>&1 || { [[ -n $pid ]] && kill "$pid" 2>/dev/null; } || true
    for _ in $(seq 60); do
        if [[ -n $pid ]]; then
            kill -0 "$pid" 2>/dev/null || return 0
        else
            rctl ping >/dev/null 2>&1 || return 0
        fi
        sleep 0.5
    done
    echo "tls_servers: $NODE did not stop" >&2
    return 1
}

rabbit_up() {
    local users
    rabbit_files
    if [[ -z $changed ]] && users=$(rctl list_users 2>/dev/null); then
        : # up, with nothing new to read
    else
        if rctl ping >/dev/null 2>&1; then
            if [[ -n $changed ]]; then
                rabbit_stop
                rabbit_spawn
            else
                rctl start_app >/dev/null
            fi
        else
            rabbit_spawn
        fi
        rabbit_wait
        users=$(rctl list_users)
    fi
    if ! awk '$1 == "tls_client"' <<<"$users" | grep -q .; then
        {
            rctl add_user tls_client "$(openssl rand -hex 24)"
            rctl clear_password tls_client
            rctl set_permissions -p / tls_client '.*' '.*' '.*'
        } >/dev/null
    fi
}

# One run at a time (tests may call `start` in parallel), under a lock on fd 9.
case "${1:-start}" in
start | stop | restart-postgres | restart-rabbitmq)
    mkdir -p "$TOP"
    chmod 0755 "$TOP"
    exec 9>"$TOP/lock"
    flock 9
    ;;
esac

case "${1:-start}" in
start)
    certs
    postgres_up
    rabbit_up
    ;;
stop)
    pgctl tls stop >/dev/null 2>&1 || true
    pgctl tls_expired stop >/dev/null 2>&1 || true
    rabbit_stop || true
    ;;
env)
    echo "TLS_CERTS=$CERTS"
    echo "TLS_PG_PORT=$pg_port"
    echo "TLS_EXPIRED_PG_PORT=$expired_port"
    echo "TLS_AMQP_PORT=$amqp_port"
    echo "TLS_RABBIT_NODE=$NODE"
    ;;
restart-postgres)
    pgctl tls stop >/dev/null 2>&1 || true
    pgctl tls start
    pg_wait "$pg_port" tls
    ;;
restart-rabbitmq)
    rctl stop_app >/dev/null
    rctl start_app >/dev/null
    rctl await_startup >/dev/null
    ;;
*)
    echo "usage: $0 [start|stop|env|restart-postgres|restart-rabbitmq]" >&2
    exit 2
    ;;
esac
