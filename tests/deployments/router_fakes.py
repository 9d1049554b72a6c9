"""Stand-ins for Serve's replicas and pending requests, to drive pdserve's request routers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest


@dataclass
class FakeReplica:
    replica_id: str
    routing_stats: dict[str, Any] = field(default_factory=dict)


def ids(tiers: list[list[FakeReplica]]) -> list[str]:
    """The replica ids of a ranking whose tiers each hold one replica."""
    assert all(len(t) == 1 for t in tiers)
    return [t[0].replica_id for t in tiers]


def make_router(cls: type, **kwargs: Any) -> Any:
    router = cls(
        deployment_id=DeploymentID(name="d", app_name="a"),
        handle_source=DeploymentHandleSource.UNKNOWN,
    )
    router.initialize_state(**kwargs)
    return router


def pending_request(arg: Any, internal_id: str) -> PendingRequest:
    return PendingRequest(
        args=[arg],
        kwargs={},
        metadata=RequestMetadata(request_id=internal_id, internal_request_id=internal_id),
    )
