#!/bin/sh
# One LoRA run on the shared pool of examples/shared-pool/pool.yaml (docs/shared-pool.md):
#   examples/shared-pool/run.sh math examples/smollm2-math-lora.yaml
#   examples/shared-pool/run.sh code examples/code/smollm2-code.yaml
# Its mesh (buffer, controller, EnvManager, trainer) starts no engines of its own: it calls the
# pool's LLMProxy with the tokens the pool knows the run by, and publishes its adapter alone, below
# the folder pool.yaml gives it (proxy.runs.NAME.adapter_root: runs/shared-NAME/weights).
set -eu
name=$1
config=$2
upper=$(echo "$name" | tr '[:lower:]' '[:upper:]')
ROLLMESH_TOKEN=$(printenv "ROLLMESH_RUN_${upper}_TOKEN")
ROLLMESH_CONTROL_TOKEN=$(printenv "ROLLMESH_RUN_${upper}_CONTROL_TOKEN")
export ROLLMESH_TOKEN ROLLMESH_CONTROL_TOKEN
exec rollmesh run "$config" \
  --set run.num_engines=0 \
  --set mesh.proxy=127.0.0.1:50051 \
  --set "train_loop.run_dir=runs/shared-$name" \
  --set "trainer.lora={rank: 16, alpha: 32}" \
  --set "train_loop.publisher={type: disk, adapter: true}"
