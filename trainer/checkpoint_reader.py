"""Reading a DCP checkpoint without running code from it.

torch 2.13's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` and the default
load planner reads a checkpoint's non-tensor values (an optimizer's ``lr``, ``betas``) with
``torch.load(weights_only=False)``: whoever can write into a run's checkpoints directory (a shared
volume, a restored backup) runs code in the trainer at its next resume. torch offers no safer
switch for either, so here: the metadata is unpickled with an allow-list of the classes DCP writes
into it (its own dataclasses, sizes, dtypes, layouts), its file names must stay inside the
checkpoint, and the values are read with ``weights_only=True`` (plain numbers, strings, lists).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo

_ALLOWED = {
    ("torch", "Size"): torch.Size,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a layout by its name
    # StorageMeta's checkpoint_id: kept as a name, never opened
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(found := getattr(dcp_metadata, name, None), type):
            return found  # Metadata, TensorStorageMetadata, MetadataIndex, ... (dataclasses and enums)
        raise pickle.UnpicklingError(f"a checkpoint's metadata may not name {module}.{name}")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        meta = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        if not isinstance(meta, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"{path}: not a checkpoint's metadata ({type(meta).__name__})")
        for info in (meta.storage_data or {}).values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or PurePosixPath(name).name != name or name in ("", ".", ".."):
                raise pickle.UnpicklingError(f"{path}: a data file {name!r} outside the checkpoint")
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafePlanner(DefaultLoadPlanner):
    """The default planner, but a value that is not a tensor is read with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # where the default planner puts it, in either of its modes
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
