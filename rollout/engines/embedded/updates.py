"""The embedded engine's weight updates and LoRA adapters: what arrives is checked in the caller's
thread, then applied by the scheduler thread between two steps (``_call``).

Every update ends in ``_bump_version``: the engine's commit. With ``kv_on_update: recompute`` it
retracts every running request (its cache dropped, re-prefilled under the new weights), so no KV
computed under old weights is reused. A bucketed update stages its tensors under the update's key
and applies them all at once; a delta or an adapter update is checked against the trainer's
checksum and put back on a mismatch.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch

from rollout.engines import weight_delta
from rollout.engines.contract import EngineError
from rollout.engines.embedded import adapter_sync
from rollout.engines.embedded.lora import read as read_adapter
from rollout.engines.embedded.routing import RoutingCapture
from rollout.engines.embedded.weights import check_named_tensors, copy_named_tensors, weights_checksum


class EngineUpdates:
    """Mixin of ``EmbeddedEngine`` (its model, adapters, staged tensors, counters and ``_call``)."""

    def load_weights_from_disk(self, path: str, weight_version: int | None) -> Future:
        """Load a HF directory (in the caller's thread) and swap it in between two steps."""
        from transformers import AutoConfig

        other = AutoConfig.from_pretrained(path, local_files_only=True)
        if other.get_text_config().vocab_size != self.vocab_size or type(other) is not type(self.hf_config):
            raise EngineError("model_path", f"{path} is a different architecture or vocabulary")
        model = self._load(path)
        state = model.state_dict()
        try:
            check_named_tensors(self.model, state)
        except ValueError as e:
            raise EngineError("model_path", f"{path} does not fit the served model: {e}") from None
        checksum = weights_checksum(state)
        return self._call(lambda: self._swap_model(model, path, weight_version, checksum))

    def stage_tensors(self, tensors: dict[str, torch.Tensor], update: object) -> int:
        """Validate a bucket of named tensors of ``update`` (a key: the version, or a collective
        update's) and hold it until ``commit_staged``; returns the staged count. Tensors staged
        for another update (one that failed midway) are dropped first, so two updates never mix."""
        self.check_tensors(tensors)
        return self._call(lambda: self._stage(tensors, update)).result()

    def check_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise ``EngineError`` unless every tensor (real or on the meta device) fits a parameter."""
        try:
            check_named_tensors(self.model, tensors)
        except ValueError as e:
            raise EngineError("tensors", str(e)) from None

    def commit_staged(self, weight_version: int | None, update: object = None) -> Future:
        """Apply every tensor staged for ``update`` (default: ``weight_version``) at once between
        two steps (they must cover every parameter) and serve ``weight_version``."""
        return self._call(lambda: self._commit_staged(weight_version, weight_version if update is None else update))

    def stage_delta(self, tensors: dict[str, torch.Tensor], version: int, base_version: int) -> int:
        """Validate a bucket of a delta update (``rollout/engines/weight_delta.py``) from
        ``base_version`` to ``version`` and hold it until ``commit_delta``; returns the staged count."""
        self._check_base(base_version)
        try:
            entries = weight_delta.split(tensors)
            weight_delta.check(self._params(), entries)
        except ValueError as e:
            raise EngineError("tensors", str(e)) from None
        return self._call(lambda: self._stage(entries, ("delta", version, base_version))).result()

    def commit_delta(self, version: int, base_version: int, checksum: str) -> Future:
        """Apply the staged delta between two steps and serve ``version``, if the weights then have
        ``checksum`` (``weights_checksum``); otherwise put back what it changed and fail."""
        return self._call(lambda: self._commit_delta(version, base_version, checksum))

    def check_adapter(self, tensors: dict[str, torch.Tensor]) -> dict:
        """A bucket of a LoRA policy's factors (``adapter_sync``; real, or on the meta device) by
        layer; ``EngineError`` naming what this model cannot take."""
        try:
            layers = adapter_sync.split(tensors)
            adapter_sync.check(self.model, layers)
        except ValueError as e:
            raise EngineError("tensors", str(e)) from None
        return layers

    def stage_adapter(self, tensors: dict[str, torch.Tensor], update: object) -> int:
        """Validate a bucket of a LoRA policy's factors (``adapter_sync``) of ``update`` (a key:
        the version, or a collective update's) and hold it until ``commit_adapter``; returns the
        staged count."""
        # On the CPU, where the base is read and the http route's tensors arrive: the merge is computed
        # there, the same bits whichever route (a CUDA handle, an NCCL receive) brought the factors.
        layers = self.check_adapter({k: t.cpu() for k, t in tensors.items()})
        try:
            self._read_base([n + ".weight" for n in layers])
        except ValueError as e:
            raise EngineError("tensors", str(e)) from None
        return self._call(lambda: self._stage(layers, ("adapter", update))).result()

    def commit_adapter(self, version: int, checksum: str, update: object = None) -> Future:
        """Set every layer staged for ``update`` (default: ``version``) to its base + scaling · B A
        between two steps and serve ``version``, if the weights then have ``checksum``; otherwise
        put them back and fail."""
        key = ("adapter", version if update is None else update)
        return self._call(lambda: self._commit_adapter(version, checksum, key))

    def _read_base(self, names: list[str]) -> None:
        # In the caller's thread: file reads. The base is the model directory this engine started
        # from (a LoRA trainer's frozen weights), whatever was loaded since.
        missing = [n for n in names if n not in self._adapter_base]
        if missing:
            self._adapter_base |= adapter_sync.base_weights(self.config.model_path, missing)

    def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> Future:
        """Read the PEFT adapter directory ``path`` (in the caller's thread) and serve it as ``name``
        between two steps; its tokens report ``version`` (default: 0)."""
        if not name:
            raise EngineError("lora_name", "must not be empty")
        if name in self.adapters.by_name:
            raise EngineError("lora_name", f"an adapter named {name!r} is loaded already (unload it first)")
        if len(self.adapters.by_name) >= self.config.max_loaded_loras:
            raise EngineError(
                "lora_name", f"{self.config.max_loaded_loras} adapters are loaded (engine.max_loaded_loras)"
            )
        adapter = read_adapter(self.model, name, Path(path), version or 0, self.device)
        return self._call(lambda: self._add_adapter(adapter))

    def unload_lora_adapter(self, name: str) -> Future:
        """Stop serving adapter ``name``; refused while a request waiting or running uses it."""
        return self._call(lambda: self._remove_adapter(name))

    def _swap_model(self, model, path: str, version: int | None, checksum: str) -> dict:
        self.adapters.rebind(model)  # first (it may refuse): the adapters' hooks belong to the old model's layers
        self.model, self.model_path, self.checksum = model, path, checksum
        if self.capture is not None:  # the hooks belong to the old model's routers
            self.capture.remove()
            self.capture = RoutingCapture(model)
        self._staged = {}  # a whole model replaces any update that was under way
        return self._bump_version(version)

    def _stage(self, tensors: dict[str, torch.Tensor], update: object) -> int:
        if update != self._staged_key:
            self._staged, self._staged_key = {}, update
        self._staged.update(tensors)
        return len(self._staged)

    def _take_staged(self, update: object) -> dict:
        """What was staged for ``update``, emptied; nothing if it was staged for another update (one
        that failed midway): that is never applied under this one."""
        staged, self._staged = self._staged, {}
        return staged if self._staged_key == update else {}

    def _commit_staged(self, version: int | None, update: object) -> dict:
        staged = self._take_staged(update)
        # A lost bucket must fail the update, not leave a model half old, half new.
        missing = [n for n, _ in self.model.named_parameters() if n not in staged]
        if missing:
            raise EngineError(
                "tensors",
                f"{len(missing)} parameters not sent for version {version} "
                f"(first: {missing[0]!r}); nothing was applied",
            )
        copy_named_tensors(self.model, staged)  # no_grad inside
        self.checksum = weights_checksum(self.model.state_dict())
        return self._bump_version(version)

    def _add_adapter(self, adapter) -> dict:
        if adapter.name in self.adapters.by_name:  # loaded by another call meanwhile
            raise EngineError("lora_name", f"an adapter named {adapter.name!r} is loaded already (unload it first)")
        self.adapters.add(adapter)
        return {"loaded_adapters": sorted(self.adapters.by_name)}

    def _remove_adapter(self, name: str) -> dict:
        if name not in self.adapters.by_name:
            raise EngineError("lora_name", f"no adapter named {name!r} is loaded")
        users = sum(r.lora == name for r in self._running + list(self._waiting))
        if users:
            raise EngineError("lora_name", f"{users} request(s) waiting or running use adapter {name!r}")
        self.adapters.remove(name)
        return {"loaded_adapters": sorted(self.adapters.by_name)}

    def _params(self) -> dict[str, torch.Tensor]:
        # What the checksum covers (a delta may write nothing it does not): no non-persistent buffer.
        return self.model.state_dict(keep_vars=True)

    def _check_base(self, base_version: int) -> None:
        if self.weight_version != base_version:  # it missed a version, or was restored to another one
            raise EngineError(
                "base_version", f"the delta is against version {base_version}; this engine holds {self.weight_version}"
            )

    def _commit_adapter(self, version: int, checksum: str, update: object) -> dict:
        staged = self._take_staged(update)
        undo = adapter_sync.apply(self.model, staged, self._adapter_base)
        return self._verified(undo, version, checksum, f"version {self.weight_version} is served unchanged")

    def _verified(self, undo: list, version: int, checksum: str, unchanged: str) -> dict:
        """The update whose ``undo`` is given, kept and served as ``version`` if the weights now have
        ``checksum``; otherwise put back (any failure while checking too) and refused."""
        try:
            got = weights_checksum(self.model.state_dict())
        except BaseException:
            weight_delta.restore(undo)
            raise
        if got != checksum:
            weight_delta.restore(undo)
            raise EngineError(
                "checksum",
                f"the weights after the update to version {version} have checksum {got}, the trainer's are "
                f"{checksum}; {unchanged}",
            )
        self.checksum = got
        return self._bump_version(version)

    def _commit_delta(self, version: int, base_version: int, checksum: str) -> dict:
        staged = self._take_staged(("delta", version, base_version))
        self._check_base(base_version)
        undo = weight_delta.apply(self._params(), staged)  # puts back its part on a failure
        return self._verified(undo, version, checksum, f"version {base_version} is served unchanged")

    def _bump_version(self, version: int | None) -> dict:
        retracted = self._retract_running() if self.config.kv_on_update == "recompute" else 0
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        self.counters["weight_updates"] += 1
        return {"weight_version": self.weight_version, "checksum": self.checksum, "retracted": retracted}
