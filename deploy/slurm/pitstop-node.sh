#!/bin/bash
# One node of a pitstop allocation, run by `srun` from pitstop.sbatch on every node: the
# checkpoint daemon (which enrolls the node with the join token the batch host minted for
# it), then the agent, which takes this shell's place (exec) so that srun's task on the
# node is the agent. Node ids are Slurm's node names. Nodes before PITSTOP_SLURM_WORKERS
# in the allocation are workers, the others hot spares. Labels come from Slurm's topology
# (topology/tree: the node's leaf switch is its rack, the switch above it its block, the
# top one its zone) unless PITSTOP_AGENT_RACK, _BLOCK or _ZONE say otherwise.
#
# Node-local state: $PITSTOP_SLURM_NODE_DIR/<node>/ (agent/, checkpointd/, agent.pid,
# checkpointd.pid); logs: $PITSTOP_SLURM_SHARED_DIR/logs/<node>-{agent,checkpointd}.log.
set -euo pipefail

node=${SLURMD_NODENAME:?pitstop-node.sh runs under srun, from pitstop.sbatch}
shared=${PITSTOP_SLURM_SHARED_DIR:?set by pitstop.sbatch}
scheduler=${PITSTOP_SCHEDULER:?set by pitstop.sbatch}
dir=${PITSTOP_SLURM_NODE_DIR:?set by pitstop.sbatch}/$node
logs=$shared/logs
mkdir -p -m 700 "$dir" "$logs"

role=worker
if ((SLURM_NODEID >= ${PITSTOP_SLURM_WORKERS:-0})); then role=spare; fi
addr=$(scontrol show node -o "$node" | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
addr=${addr:-$(hostname)}

rack="" block="" zone="" top=1
while read -r line; do
    name=$(sed -n 's/^SwitchName=\([^ ]*\).*/\1/p' <<<"$line")
    level=$(sed -n 's/.* Level=\([0-9]*\).*/\1/p' <<<"$line")
    if [ -z "$name" ] || [ -z "$level" ]; then continue; fi
    if ((level == 0)); then rack=$name; elif ((level == 1)); then block=$name; fi
    if ((level > top)); then zone=$name top=$level; fi
done < <(scontrol show topology "$node" 2>/dev/null || true)
labels=()
rack=${PITSTOP_AGENT_RACK:-$rack} block=${PITSTOP_AGENT_BLOCK:-$block}
zone=${PITSTOP_AGENT_ZONE:-$zone}
if [ -n "$rack" ]; then labels+=(--rack "$rack"); fi
if [ -n "$block" ]; then labels+=(--block "$block"); fi
if [ -n "$zone" ]; then labels+=(--zone "$zone"); fi

token_file=$shared/join/$node.token
log=$logs/$node-checkpointd.log
: >"$log"
PITSTOP_CHECKPOINTD_JOIN_TOKEN=$(cat "$token_file") \
    PITSTOP_CHECKPOINTD_CA_FILE=$shared/ca.crt \
    pitstop-checkpointd run --node-id "$node" --host "$addr" --port 0 \
    --scheduler "$scheduler" --state-dir "$dir/checkpointd" --tls-dir "$dir/agent/tls" \
    --durable-url "${PITSTOP_SLURM_DURABLE_URL:-file://$shared/durable}" >"$log" 2>&1 &
checkpointd_pid=$!
echo "$checkpointd_pid" >"$dir/checkpointd.pid"
checkpointd=""
for _ in $(seq 600); do
    checkpointd=$(sed -n 's/^pitstop-checkpointd [^ ]* listening on \([^ ]*:[0-9]*\) .*/\1/p' "$log")
    if [ -n "$checkpointd" ]; then break; fi
    if ! kill -0 "$checkpointd_pid" 2>/dev/null; then
        echo "pitstop-node.sh: the checkpoint daemon of $node exited; its log ($log):" >&2
        tail -20 "$log" >&2
        exit 1
    fi
    sleep 0.1
done
if [ -z "$checkpointd" ]; then
    echo "pitstop-node.sh: the checkpoint daemon of $node was not listening after 60 s; see $log" >&2
    exit 1
fi
rm -f "$token_file" # used: the node is enrolled

echo $$ >"$dir/agent.pid"
exec pitstop-agent run --node-id "$node" --scheduler "$scheduler" --tls \
    --ca-file "$shared/ca.crt" --role "$role" --state-dir "$dir/agent" \
    --socket-path "$dir/agent.sock" --checkpointd-address "$checkpointd" \
    --advertise-host "$addr" "${labels[@]}" >"$logs/$node-agent.log" 2>&1
