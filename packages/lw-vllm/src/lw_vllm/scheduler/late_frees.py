"""Background saves, scheduler part (``LateFrees``, owned by ``SchedulerSide``): which finished
requests vLLM frees late.

With background saves (``pool.saves_in_background``) a step's saves may still read a request's
blocks after vLLM finished it: a request that had saves planned keeps its blocks
(``request_finished`` answers ``True``) until every worker lists it in ``finished_sending``. The
workers learn of such requests from the next step plan's ``free_late`` (``save_ledger`` on the
worker side), and of the step's preempted requests, whose blocks vLLM frees at once, from its
``preempted``.

While such blocks are held (``pending``), vLLM's scheduler waits for them instead of preempting a
running request when it runs out of blocks (``has_pending_block_frees``): they come back within a
save's deadlines.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lw_vllm.meta import LayerwiseMeta
from lw_vllm.request.request_state import ReqState


class LateFrees:
    def __init__(self, background: bool) -> None:
        self.background = background
        self.sending: dict[str, ReqState] = {}  # finished, blocks held until finished_sending
        self._new: list[str] = []  # held since the last step plan

    def hold(self, st: ReqState) -> bool:
        """Whether vLLM must keep the blocks of ``st``'s finished request: its saves may still read
        them (vLLM frees them once every worker lists it in ``finished_sending``)."""
        if not (self.background and st.save_planned):
            return False
        self.sending[st.req.request_id] = st
        self._new.append(st.req.request_id)
        return True

    def plan(self, meta: LayerwiseMeta, so: Any) -> None:
        """Tell the workers, in the step plan, of the requests held since the last plan and of the
        step's preempted requests (scheduler output ``so``)."""
        meta.free_late, self._new = self._new, []
        if self.background:
            meta.preempted = list(getattr(so, "preempted_req_ids", None) or ())

    def pending(self) -> bool:
        """Whether blocks of finished requests are held for their saves (they come back once the
        workers report them in ``finished_sending``)."""
        return bool(self.sending)

    def get(self, req_id: str) -> ReqState | None:
        return self.sending.get(req_id)

    def sent(self, req_ids: Iterable[str]) -> list[ReqState]:
        """The held requests among ``req_ids`` (``finished_sending``), no longer held: vLLM frees them now."""
        return [self.sending.pop(rid) for rid in req_ids if rid in self.sending]

    def drain(self) -> list[ReqState]:
        """Every request still held (shutdown)."""
        out = list(self.sending.values())
        self.sending.clear()
        return out
