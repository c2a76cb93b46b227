#!/usr/bin/env bash
# An sshd of its own on 127.0.0.1, and pdsh, for the test of DeepSpeed's multi-node launcher (which
# reaches the hosts of a hostfile with pdsh over passwordless ssh).
#
# Keys, config and pid live in one directory; nothing of the machine's own ssh setup (root's
# ~/.ssh, /etc/ssh) is read or changed. Idempotent. Needs root (apt-get, sshd).
#
#   bash tests/cluster/sshd_up.sh          # install if missing, make keys, start sshd
#   then: PDSH_SSH_ARGS_APPEND="-i $DIR/id -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
#         and the port TFORMER_SSH_PORT
#   bash tests/cluster/sshd_up.sh --down   # stop it
#
# Settings (environment): TFORMER_SSH_DIR (default /tmp/tformer-ssh), TFORMER_SSH_PORT (default 16822).
set -euo pipefail

DIR=${TFORMER_SSH_DIR:-/tmp/tformer-ssh}
PORT=${TFORMER_SSH_PORT:-16822}

die() { echo "sshd_up: $*" >&2; exit 1; }

if [ "${1:-}" = "--down" ]; then
    [ -f "$DIR/sshd.pid" ] && kill "$(cat "$DIR/sshd.pid")" 2>/dev/null || true
    exit 0
fi

[ "$(id -u)" = 0 ] || die "needs root (apt-get install, sshd)"
if ! command -v pdsh >/dev/null || [ ! -x /usr/sbin/sshd ]; then
    echo "sshd_up: installing pdsh openssh-server (Debian packages)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq pdsh openssh-server openssh-client >/dev/null \
        || die "apt-get install of pdsh openssh-server failed"
fi

mkdir -p "$DIR" /run/sshd
chmod 700 "$DIR"
[ -f "$DIR/host_key" ] || ssh-keygen -q -t ed25519 -N "" -f "$DIR/host_key"
[ -f "$DIR/id" ] || ssh-keygen -q -t ed25519 -N "" -f "$DIR/id"
cp "$DIR/id.pub" "$DIR/authorized_keys" && chmod 600 "$DIR/authorized_keys"
cat >"$DIR/sshd_config" <<EOF
Port $PORT
ListenAddress 127.0.0.1
HostKey $DIR/host_key
AuthorizedKeysFile $DIR/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile $DIR/sshd.pid
EOF

if [ -f "$DIR/sshd.pid" ] && kill -0 "$(cat "$DIR/sshd.pid")" 2>/dev/null; then
    kill "$(cat "$DIR/sshd.pid")" 2>/dev/null || true  # restart: the config may have changed
    sleep 0.5
fi
/usr/sbin/sshd -f "$DIR/sshd_config" -E "$DIR/sshd.log" || die "sshd did not start (see $DIR/sshd.log)"
for _ in $(seq 50); do
    ssh -i "$DIR/id" -p "$PORT" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
        -o LogLevel=ERROR -o BatchMode=yes 127.0.0.1 true 2>/dev/null && exit 0
    sleep 0.1
done
die "ssh to 127.0.0.1:$PORT with $DIR/id does not work (see $DIR/sshd.log)"
