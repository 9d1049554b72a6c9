#!/usr/bin/env bash
# The aware-vs-blind multi-turn experiment of docs/prefix-routing.md, in one sitting: one
# local cluster (a prefill replica, two decode replicas of the small test model), the same
# saved conversations against prefix-aware and then prefix-blind routing. Run from the
# repository root under the cluster lock:
#   flock /tmp/pdserve-cluster.lock docs/prefix-routing/run.sh OUT_DIR
set -euo pipefail
out=${1:?usage: run.sh OUT_DIR}
mkdir -p "$out"
export PDSERVE_STATE_DIR=$(mktemp -d)
trap '.venv/bin/pdserve down >/dev/null 2>&1 || true; rm -rf "$PDSERVE_STATE_DIR"' EXIT
.venv/bin/pdserve up --prefill-cpus 1 --decode-cpus 1 --no-pin-cpus
tok=$(ls -d models/pdserve-small-* | head -1)
state=$PDSERVE_STATE_DIR/cluster.json
metrics=$(.venv/bin/python -c "
import json; s = json.load(open('$state'))
print(' '.join(f'--metrics-url http://{s[\"node_ip\"]}:{n[\"metrics_export_port\"]}/metrics' for n in s['nodes']))")
.venv/bin/python -P -m pdserve.bench.serve --endpoint unused=http://127.0.0.1:1 --tokenizer "$tok" \
  --workload multiturn --conversations "${CONVERSATIONS:-12}" --turns fixed:4 \
  --system-len 512 --num-system-prompts 4 --context-len "${CONTEXT_LEN:-384}" \
  --user-len uniform:32:64 --output-len fixed:16 \
  --think-time-s 2 --conversation-rate "${RATE:-0.2}" --seed 0 --out-dir "$out/workload" --dry-run
for mode in ${MODES:-aware blind}; do
  .venv/bin/pdserve serve "docs/prefix-routing/$mode.yaml"
  url=$(.venv/bin/python -c "
import json; s = json.load(open('$state'))['serve']; print(f'http://{s[\"http_host\"]}:{s[\"http_port\"]}')")
  # shellcheck disable=SC2086
  .venv/bin/python -P -m pdserve.bench.serve --endpoint "$mode=$url" --tokenizer "$tok" \
    --workload multiturn --replay "$out/workload/conversations.json" \
    --out-dir "$out/$mode" $metrics
done
