"""The gateway's session routes: open a session (in a group, or a group of its own), describe it,
give it a reward, end it or give its group up (its group goes to the SampleBuffer once every member has ended)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from rollout.agent.sessions import AgentSessions, SessionError
from sample_buffer.errors import TransientError
from services.gateway.openai_api import EndRequest, RewardRequest, SessionRequest


def session_router(sessions: AgentSessions) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/sessions")
    async def create_session(request: Request, body: SessionRequest | None = None):
        body = body or SessionRequest()
        session = await sessions.create(request.state.owner, body.group, body.group_size)
        return {
            "id": session.session_id,
            "group": session.group.group_id,
            "group_size": session.group.size,
            "base_url": f"{str(request.base_url).rstrip('/')}/sessions/{session.session_id}/v1",
        }

    @router.get("/v1/sessions/{session_id}")
    async def describe_session(request: Request, session_id: str):
        s = sessions.get(session_id, request.state.owner)
        return {
            "id": s.session_id,
            "group": s.group.group_id,
            "requests": s.requests,
            "reward": s.reward,
            "ended": s.ended,
            "branches": len(s.tree.tips()),
            "forks": s.tree.forks,
        }

    @router.post("/v1/sessions/{session_id}/reward")
    async def reward_session(request: Request, session_id: str, body: RewardRequest):
        sessions.set_reward(sessions.get(session_id, request.state.owner), body.reward)
        return {"id": session_id, "reward": body.reward}

    @router.post("/v1/sessions/{session_id}/abandon")
    async def abandon_session(request: Request, session_id: str):
        session = sessions.get(session_id, request.state.owner)
        await sessions.abandon(session)
        return {"id": session_id, "group": session.group.group_id, "group_state": "abandoned"}

    @router.post("/v1/sessions/{session_id}/end")
    async def end_session(request: Request, session_id: str, body: EndRequest | None = None):
        session = sessions.get(session_id, request.state.owner)
        try:
            group = await sessions.end(session, (body or EndRequest()).reward)
        except TransientError as e:
            raise SessionError(f"the SampleBuffer is not reachable now ({e})", status=503, code="unavailable") from None
        return {"id": session_id, "ended": True, "group": session.group.group_id, "group_state": group}

    return router
