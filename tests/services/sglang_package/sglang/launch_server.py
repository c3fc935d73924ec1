"""``python -m sglang.launch_server`` for tests, where SGLang cannot run (no GPU): it accepts
SGLang's own flag names, and only those rollmesh sends (an unknown or misspelt one fails the
start, as it would in SGLang's parser), records the argv it got (``SGLANG_STANDIN_ARGV``), and
serves the SGLang stand-in (``tests/services/sglang_standin.py``) as the flags say: model, port,
dtype, seed, starting weight version, and ``api-key`` on every route but /health and /metrics.
As SGLang's, ``--config FILE`` reads flags from YAML (long names without dashes in front); the
command line wins; an unknown key fails the start."""

import argparse
import json
import os
import sys

import uvicorn
import yaml
from fastapi.responses import JSONResponse

from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from tests.services.sglang_standin import create_standin

p = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
for flag in ("--model-path", "--host", "--served-model-name", "--api-key", "--ssl-certfile", "--ssl-keyfile"):
    p.add_argument(flag)
p.add_argument("--port", type=int, required=True)
p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto")
for flag in ("--tp-size", "--random-seed", "--max-running-requests", "--context-length"):
    p.add_argument(flag, type=int)
p.add_argument("--mem-fraction-static", type=float)
p.add_argument("--weight-version", default="default")
p.add_argument("--enable-metrics", action="store_true")
p.add_argument("--enable-memory-saver", action="store_true")
p.add_argument("--enable-return-routed-experts", action="store_true")
p.add_argument("--grammar-backend", choices=["xgrammar", "outlines", "llguidance", "none"])  # the stand-in: xgrammar
p.add_argument("--config")
config_file = p.parse_known_args()[0].config
if config_file and not config_file.endswith((".yaml", ".yml")):  # as SGLang's ConfigArgumentMerger
    p.error(f"Config file must be YAML format, got: {config_file}")
if config_file:
    with open(config_file) as f:
        values = {k.replace("-", "_"): v for k, v in (yaml.safe_load(f) or {}).items()}
    unknown = sorted(set(values) - {a.dest for a in p._actions})
    if unknown:
        p.error(f"--config {config_file}: unknown keys {unknown}")
    p.set_defaults(**values)
args = p.parse_args()
if os.environ.get("SGLANG_STANDIN_ARGV"):
    with open(os.environ["SGLANG_STANDIN_ARGV"], "w") as f:
        json.dump(sys.argv[1:], f)

dtype = "float32" if args.dtype == "auto" else args.dtype
config = EngineConfig(
    model_path=args.model_path,
    dtype=dtype,
    seed=args.random_seed or 0,
    max_running_requests=args.max_running_requests or 8,
)
engine = EmbeddedEngine(config).start()
app = create_standin(engine, args.weight_version)


@app.middleware("http")
async def api_key(request, call_next):
    if (
        args.api_key
        and request.url.path not in ("/health", "/metrics")
        and (request.headers.get("authorization") != f"Bearer {args.api_key}")
    ):
        return JSONResponse(status_code=401, content={"error": "Unauthorized"})
    return await call_next(request)


uvicorn.run(app, host=args.host or "127.0.0.1", port=args.port, log_level="warning")
