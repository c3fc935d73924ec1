"""Group filters applied at put time. Each returns a drop reason or None to keep the group."""

from __future__ import annotations

from collections.abc import Callable

from sample_buffer.codec import GroupHeader
from sample_buffer.trajectory import PutRefusal

GroupFilter = Callable[[GroupHeader], str | None]


def zero_variance(header: GroupHeader) -> str | None:
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero advantage everywhere
    (unless a teacher scored it: its per-token distillation signal is there whatever the rewards)."""
    if not header.taught and len(header.rewards) > 1 and max(header.rewards) - min(header.rewards) == 0.0:
        return PutRefusal.FILTERED
    return None
