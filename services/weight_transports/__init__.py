"""Weight transports: how the trainer's new weights reach the engines (``train_loop.publisher.type``).

Each module holds one transport, both sides: the trainer's (a ``WeightPublisher``, the training
loop's port: export, load, committed) and its config, and the embedded engine's receiving routes
(``add_engine_routes``; SGLang and vLLM receive with their own). Adding one: a module here, one
entry in ``TRANSPORTS`` and ``ENGINE_ROUTES``, the engine backends that receive it
(``services/engine/backends.py``), tests.
"""

from __future__ import annotations

from sample_buffer.registry import tagged_union
from services.weight_transports import collective, disk, http_buckets, ipc
from services.weight_transports.collective import CollectivePublisherConfig
from services.weight_transports.disk import DiskPublisherConfig
from services.weight_transports.http_buckets import BucketPublisherConfig
from services.weight_transports.ipc import IpcPublisherConfig

# type -> its config; each config's build(proxy, run_dir, keep_versions) makes the publisher.
TRANSPORTS = {
    "disk": DiskPublisherConfig,
    "http_buckets": BucketPublisherConfig,
    "collective": CollectivePublisherConfig,
    "ipc": IpcPublisherConfig,
}

PublisherConfig = tagged_union(*TRANSPORTS.values(), default="disk")

# type -> how the embedded engine's server receives it: add_engine_routes(app, EngineSide).
ENGINE_ROUTES = {
    "disk": disk.add_engine_routes,
    "http_buckets": http_buckets.add_engine_routes,
    "collective": collective.add_engine_routes,
    "ipc": ipc.add_engine_routes,
}
