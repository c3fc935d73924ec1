"""The reward service's client: a reward (``(response, answer) -> float``) that asks a RewardService.

Environments call rewards from their step threads, so the call is a blocking gRPC call on a
channel shared by every thread. A service that is not there is asked again (one `rollmesh run`
restarted is back within seconds), never past the call's deadline; a score that does not come back
is 0, counted by cause (``timeout``, ``unreachable``, ``error``), and so is one the service
reports as a fault, by the cause it gives (``timeout``, ``raised``, ``crashed``, a sandbox's
``memory``, a judge's ``unparsed``, ...).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter

import grpc

from rollout.verifiers.service import GRACE_S, ServiceRewardConfig
from services.auth import AuthConfig, grpc_sync_channel
from services.grpc_util import RECONNECT_OPTIONS
from services.pb.rollmesh.v1 import reward_pb2 as pb

log = logging.getLogger(__name__)
FAILURE_CAUSES = ("timeout", "unreachable", "error")  # of the call; the service's causes add to these
RETRY_S = 0.2
_CAUSE = {grpc.StatusCode.DEADLINE_EXCEEDED: "timeout", grpc.StatusCode.UNAVAILABLE: "unreachable"}


class RewardClient:
    def __init__(self, address: str, timeout_s: float, auth: AuthConfig | None = None) -> None:
        self.address, self.timeout_s = address, timeout_s
        auth = auth or AuthConfig()
        self._channel = grpc_sync_channel(address, auth, RECONNECT_OPTIONS)
        bearer = auth.bearer()
        self._metadata = (("authorization", bearer),) if bearer else None
        self._score = self._channel.unary_unary(
            "/rollmesh.v1.RewardService/Score",
            request_serializer=pb.ScoreRequest.SerializeToString,
            response_deserializer=pb.ScoreResponse.FromString,
        )
        self.failures: Counter[str] = Counter(dict.fromkeys(FAILURE_CAUSES, 0))
        self.calls = 0
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, spec: ServiceRewardConfig, default_address: str | None, auth: AuthConfig | None):
        address = spec.address or default_address
        if not address:
            raise ValueError(
                "reward.address: where is the reward service? (host:port; `rollmesh run` fills in "
                "mesh.reward when it starts one)"
            )
        return cls(address, spec.timeout_s, auth)

    def __call__(self, response: str, answer: str) -> float:
        with self._lock:
            self.calls += 1
        request = pb.ScoreRequest(
            response=response, answer=str(answer), timeout_s=self.timeout_s, request_id=uuid.uuid4().hex[:12]
        )
        deadline = time.monotonic() + self.timeout_s + GRACE_S
        while True:
            left = deadline - time.monotonic()
            request.timeout_s = max(0.01, left - GRACE_S)  # the service bounds its work by what is left
            try:
                reply = self._score(request, timeout=max(0.01, left), metadata=self._metadata)
                break
            except grpc.RpcError as e:
                # Not there (yet, or again: a restart is back within seconds): ask again until the deadline.
                if e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() + RETRY_S < deadline:
                    time.sleep(RETRY_S)
                    continue
                log.warning("reward service %s: %s %s (scored 0)", self.address, e.code().name, e.details())
                return self._failed(_CAUSE.get(e.code(), "error"))
        if reply.failure:
            return self._failed(reply.failure[:32])
        return float(reply.reward)

    def _failed(self, cause: str) -> float:
        with self._lock:
            self.failures[cause] += 1
        return 0.0

    def close(self) -> None:
        self._channel.close()
