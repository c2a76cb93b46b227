#!/usr/bin/env bash
# Launch `tformer train` with `accelerate launch` and a shipped accelerate config.
#
#   launch/accelerate.sh CONFIG.yaml [key=value ...]
#
# Environment (defaults in brackets):
#   ACCELERATE_CONFIG  accelerate config file [launch/accelerate/one_node.yaml]
#   NPROC_PER_NODE     overrides the config's num_processes (one node) [from the config]
#   MAIN_PORT          main process port [29500]
#   ACCELERATE         the accelerate command [accelerate]
# accelerate only starts the processes; the recipe's parallel.strategy does the distribution.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: launch/accelerate.sh CONFIG.yaml [key=value ...]" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-$here/accelerate/one_node.yaml}
ACCELERATE=${ACCELERATE:-accelerate}
[ -f "$ACCELERATE_CONFIG" ] || { echo "launch/accelerate.sh: accelerate config $ACCELERATE_CONFIG not found: set ACCELERATE_CONFIG to one of launch/accelerate/*.yaml" >&2; exit 2; }
command -v "$ACCELERATE" >/dev/null 2>&1 \
    || { echo "launch/accelerate.sh: '$ACCELERATE' not found: pip install accelerate (or set ACCELERATE=/path/to/accelerate)" >&2; exit 2; }

args=(--config_file "$ACCELERATE_CONFIG" --main_process_port "${MAIN_PORT:-29500}")
[ -n "${NPROC_PER_NODE:-}" ] && args+=(--num_processes "$NPROC_PER_NODE")
echo "tformer launch: accelerate with $ACCELERATE_CONFIG${NPROC_PER_NODE:+, $NPROC_PER_NODE process(es)}" >&2
exec "$ACCELERATE" launch "${args[@]}" -m tformer train "$@"
