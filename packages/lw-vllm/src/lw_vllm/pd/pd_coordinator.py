"""The scheduler side's PD coordinator (docs/design/architecture.md §6): ``PdCoordinator``, owned by ``SchedulerSide``.

Decoder: a request whose ``kv_transfer_params`` carry ``do_remote_prefill`` and a ``metaserver`` URL
POSTs to the metaserver once (pd_metaserver, off this thread) and is reported "not ready yet"
(``None``) until its prefill is there; then it is looked up and loaded. "There" is whichever comes
first: the metaserver's 200, or the pool holding the whole prompt (the prefiller commits its objects
before it answers, and the proxy's answer is three HTTP hops later; see ``POOL_POLL_S``).
Before posting, the decoder checks whether its local prefix cache plus the pool already hold every
full chunk of the prompt; if so its POST says ``needs_prefill: false`` and it does not wait. For a
recurrent-state model (``states``) that is what its hit can load: the chunks up to the last
boundary before the prompt's last token (``state_plan.last_boundary``) and the state there; chunks
without that state are no hit (the proxy would skip the prefill and the decoder recompute the prompt).

A request whose params carry ``lw_prefilled`` (lw-proxy: a non-streamed answer continued after
its prefill answered) has the prefill's generated tokens at the end of its prompt: it calls no
metaserver and loads the prefill's prompt, partial chunk included, so it computes only those tokens
and what follows them.

A request whose params carry ``lw_first_token`` (lw-proxy: one prompt; each choice's engine request
is answered with its own choice's token) says ``forces_first`` in its
POST when this engine runs ``first_token.FirstTokenProcessor``, waits for the answer even when the
pool already holds its prompt, and takes the answer's first token when its digest names this
prompt: the decoder then continues from the token the proxy relayed to the client. A streaming
receive of such a request ``holds`` (``stream_recv``): it is reported, and vLLM schedules the
request, only once the answer was passed to it, so the token is the request's before that.

The whole prompt travels: the prefiller also saves the trailing partial chunk under a key scoped to
the parent request (``lw_parent_id``, ``keys.partial_chunk_hash``) unless ``discard_partial_chunks``
is true, and the decoder loads it, so it recomputes only the last prompt token.

State this module owns (nothing else writes it): the metaserver client (``None`` on a prefiller),
the streaming receives parked by vLLM and not yet sent to the workers, the receives sent whose
metaserver answer is still to come, the idle-wait bookkeeping (the step index and whether that
step ran nothing), and the throttle of the "committed but not in this pool" warning. Per-request
state stays in the caller's ``ReqState``; the pool is reached only through the ``lookup`` function
the scheduler side hands in (its deadline and back-off apply).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from lw_core.config import PoolConfig
from lw_core.keys import KeySpace, chunk_hashes, partial_chunk_hash
from lw_core.wire import prompt_digest
from lw_vllm.hybrid.group_blocks import GroupBlocks
from lw_vllm.hybrid.state_plan import last_boundary
from lw_vllm.meta import LayerwiseMeta
from lw_vllm.metrics import Collector
from lw_vllm.pd import first_token
from lw_vllm.pd.pd_metaserver import MetaserverClient, remote_prefill_params
from lw_vllm.request.request_keys import prompt_tokens
from lw_vllm.request.request_state import Outcome, RemotePhase, RemotePrefill, ReqState

if TYPE_CHECKING:
    from collections.abc import Callable

    from lw_vllm.hybrid.state_plan import StatePlan

log = logging.getLogger(__name__)

# While requests wait for their remote prefill, vLLM runs an empty step about every millisecond
# (scheduler + worker round trip): measured, that burns more than one CPU core, which on a
# shared host starves the very prefiller being waited for. When the last step ran nothing, one
# scheduling pass waits up to this long for a metaserver answer (waking at once on one, or when the
# pool holds the waiting request's prompt); a new request arriving meanwhile is scheduled at most
# this much later.
IDLE_WAIT_S = 0.02
# A waiting request looks at the pool for its prompt's last object at most this often.
POOL_POLL_S = 0.001
# "The prefill is committed but this pool holds none of it" is logged at most this often (each
# occurrence is counted in ``pd_prefill_not_in_pool``).
NOT_IN_POOL_LOG_S = 60.0
# Remote-prefill params a client may have made up (a metaserver URL not allowed, malformed params)
# are logged at most this often (each refused URL is counted in ``pd_metaserver_refused``).
REFUSED_LOG_S = 60.0


class Lookup(Protocol):
    """The scheduler side's pool lookup: leading ``hashes`` every rank of ``tags`` holds under
    ``keyspace`` (this engine's when ``None``). Raises when the pool cannot answer."""

    def __call__(self, hashes: list[bytes], keyspace: KeySpace | None = None,
                 tags: list[str] | None = None) -> int: ...


def parent_id(req: Any) -> str | None:
    """``lw_parent_id`` of a PD request (decoder or prefiller side), else ``None``."""
    raw = getattr(req, "kv_transfer_params", None)
    if not isinstance(raw, dict):
        return None
    pid = raw.get("lw_parent_id")
    if not isinstance(pid, str) or not pid:
        return None
    return pid if raw.get("do_remote_decode") or raw.get("do_remote_prefill") else None


class PdCoordinator:
    """PD for one scheduler side. ``cfg``: the pool config (``discard_partial_chunks``,
    ``pd_streaming``); ``block_size``, ``keyspace``, ``tags``: this engine's chunking and keys;
    ``other_tp``: key space and rank tags of this model at other TP sizes (to name a mismatch);
    ``metaserver``: the decoder's client (``None`` on a prefiller, which never waits), owned from
    here on (``close``); ``metrics``: where ``metaserver_wait_s`` and ``pd_prefill_not_in_pool`` go;
    ``lookup``: the scheduler side's pool lookup; ``tp_mismatch``: why KV saved at a TP size is not
    read by this engine (``pool.tp_mismatch`` bound to the engine's config)."""

    def __init__(self, cfg: PoolConfig, block_size: int, keyspace: KeySpace, tags: list[str],
                 other_tp: dict[int, tuple[KeySpace, list[str]]], metaserver: MetaserverClient | None,
                 metrics: Collector, lookup: Lookup, tp_mismatch: Callable[[int], str],
                 groups: GroupBlocks | None = None, states: StatePlan | None = None,
                 forces_first: bool = False) -> None:
        """``groups``: the scheduler side's block groups (a hybrid's receives carry every attention
        group's blocks); ``None``: one group. ``states``: the model's recurrent-state plan when it
        restores states, so a hit ends where the prefiller is handed one (``stream_match``,
        ``_load_end``) and the pool holds a prompt only with that state. ``forces_first``: this
        engine runs ``first_token.FirstTokenProcessor``, so a request may continue from the
        prefill's first token (``lw_first_token``; see ``_continue_from_prefill``)."""
        self.cfg = cfg
        self.forces_first = forces_first
        self.states = states
        self.groups = groups if groups is not None else GroupBlocks(0, [])
        self.block_size = block_size
        self.keyspace = keyspace
        self.tags = tags
        self.other_tp = other_tp
        self.metaserver = metaserver
        self.metrics = metrics
        self._lookup = lookup
        self._tp_mismatch = tp_mismatch
        self._build = 0  # index of the step plan being built (the scheduler side counts them)
        self._last_step_empty = False
        self._idle_waited_at = -1  # build index of the scheduling pass that last idle-waited
        self._stream_pending: list[ReqState] = []  # parked requests to hand to the workers
        self._streams: dict[str, ReqState] = {}  # receives sent, metaserver not answered
        self._not_in_pool_logged_at: float | None = None
        self._not_in_pool_unlogged = 0
        self._refused_logged_at: float | None = None
        self._refused_unlogged = 0

    # --- the scheduler side's calls ---
    def begin_step(self, build: int, empty: bool) -> None:
        """A step plan is being built (index ``build``); ``empty``: the step scheduled no token, so
        the next scheduling pass may idle-wait for a metaserver answer."""
        self._build = build
        self._last_step_empty = empty

    def park(self, st: ReqState, blocks: Any) -> None:
        """After vLLM allocated ``st``'s blocks: a streaming receive not sent yet is parked (vLLM
        holds it in ``WAITING_FOR_REMOTE_KVS``) until the next step plan hands it to the workers."""
        if st.remote is not None and st.remote.phase is RemotePhase.STREAMING and not st.stream_sent:
            self.groups.set(st, blocks.get_block_ids())  # parked: no scheduler output will carry them
            st.stream_pending = True
            self._stream_pending.append(st)

    def plan_streams(self, meta: LayerwiseMeta) -> None:
        """Streaming PD: the receives to start and the metaserver answers to relay, into ``meta``."""
        self._send_streams(meta)
        self._pass_stream_answers(meta)

    def request_finished(self, request_id: str, st: ReqState | None) -> None:
        """``st``: the request's state, ``None`` when the scheduler side had none (an abort)."""
        self._streams.pop(request_id, None)
        if self.metaserver is not None:
            # A request that finishes while still waiting was aborted: its call goes too. One that
            # never waited (nothing to load) leaves its call running for its siblings' sake.
            self.metaserver.forget(request_id, cancel=st is None or (st.remote is not None and st.remote.waiting))

    def close(self) -> None:
        if self.metaserver is not None:
            self.metaserver.close()

    def _saved_at_other_tp(self, first_hash: bytes) -> int | None:
        """The TP size of an engine of this model that saved the chunk ``first_hash``, if not ours."""
        for tp, (ks, tags) in self.other_tp.items():
            try:
                if self._lookup([first_hash], ks, tags[:1]) == 1:
                    return tp
            except Exception:
                return None
        return None

    def check_prefill_visible(self, st: ReqState, hashes: list[bytes], local: int, limit: int, hit: int) -> None:
        """Decoder: the metaserver said the prefill is committed (or the proxy continues a prefill
        that answered, ``PREFILLED``: committed too), yet the pool holds none of the chunks this
        engine lacks. Nothing is wrong with the answer (vLLM computes the prompt), but every such
        request pays a full prefill twice and the operator must hear why: counted in
        ``pd_prefill_not_in_pool``, logged once per ``NOT_IN_POOL_LOG_S`` with the likely causes."""
        committed = st.remote is not None and (st.remote.answered_ok or st.remote.phase is RemotePhase.PREFILLED)
        if not committed or st.pool_seen or hit > local or limit <= local:
            return
        self.metrics.add(pd_prefill_not_in_pool=1)
        now = time.monotonic()
        last = self._not_in_pool_logged_at
        if last is not None and now - last < NOT_IN_POOL_LOG_S:
            self._not_in_pool_unlogged += 1
            return
        other_tp = self._saved_at_other_tp(hashes[local])
        if other_tp is not None:
            # Never a silent miss: name both sizes (logged for every such request).
            log.error("lw-vllm: %s: the pool holds its prefill, but %s. The prompt is computed here.",
                      st.req.request_id, self._tp_mismatch(other_tp))
            return
        more = self._not_in_pool_unlogged
        self._not_in_pool_logged_at, self._not_in_pool_unlogged = now, 0
        log.warning(
            "lw-vllm: %s: its prefill answered (so it committed), but this decoder's pool holds none of "
            "its %d chunk(s) (first key %s). Likely causes: the prefiller writes to another pool (e.g. each host "
            "on its own embedded pool: use a pool both reach, such as backend memcache); a different model "
            "identity (the key's model part is the model's config and weights, or model_id: check both "
            "engines run the same weights, dtype and model_id); a different block size or KV layout (this "
            "engine: block_size %d, layout %s); or the prefiller's saves failed (its "
            "vllm:lw_pool_save_failed_objects_total). The prompt is computed here. Counted in "
            "vllm:lw_pool_pd_prefill_not_in_pool_total; logged at most every %.0f s%s.",
            st.req.request_id, limit - local, self.keyspace.key(self.tags[0], hashes[local]), self.block_size,
            self.keyspace.layout_fp, NOT_IN_POOL_LOG_S,
            f" ({more} more since the last message)" if more else "",
        )

    def _log_refused(self, request_id: str, why: str) -> None:
        """Remote-prefill params refused (made up by a client, or a misconfigured proxy): one line
        per ``REFUSED_LOG_S``, saying how many more there were, never one per request."""
        now = time.monotonic()
        last = self._refused_logged_at
        if last is not None and now - last < REFUSED_LOG_S:
            self._refused_unlogged += 1
            return
        more = self._refused_unlogged
        self._refused_logged_at, self._refused_unlogged = now, 0
        log.warning("lw-vllm: %s: remote prefill refused: %s; no metaserver is called, the request is computed "
                    "here (from what the pool holds). Logged at most every %.0f s%s.", request_id, why,
                    REFUSED_LOG_S, f" ({more} more refused since the last message)" if more else "")

    def prompt_hashes(self, st: ReqState) -> list[bytes]:
        """Full chunks of the prompt, then (PD, ``discard_partial_chunks`` false) the partial one. A
        request continuing an answered prefill (``prefilled_tail``): those of the prefill's prompt,
        its own but for the tokens the prefill generated."""
        if st.pd_hashes is None:
            toks = prompt_tokens(st.req)
            if st.prefilled_tail:
                toks = toks[:len(toks) - st.prefilled_tail]
            digests = st.input_digests(self.block_size)
            full = chunk_hashes(toks, self.block_size, st.extra, digests)
            out = list(full)
            if st.parent is not None and not self.cfg.discard_partial_chunks:
                ph = partial_chunk_hash(toks, self.block_size, st.parent, st.extra, full_hashes=full,
                                        chunk_digests=digests)
                if ph is not None:
                    out.append(ph)
            st.pd_hashes = out
        return st.pd_hashes

    def partial_save(self, st: ReqState, computed_after: int) -> tuple[bytes, int] | None:
        """Prefiller: (hash, block) of the trailing partial chunk once the prompt is computed."""
        if st.partial_saved or st.parent is None or self.cfg.discard_partial_chunks or computed_after < st.prompt_len:
            return None
        st.partial_saved = True
        if not (getattr(st.req, "kv_transfer_params", None) or {}).get("do_remote_decode"):
            return None  # only a prefill's partial chunk has a decoder waiting for it
        i = st.prompt_len // self.block_size
        hashes = self.prompt_hashes(st)
        if st.prompt_len % self.block_size == 0 or len(hashes) <= i or i >= len(st.block_ids):
            return None
        return hashes[i], st.block_ids[i]

    def _load_end(self, st: ReqState) -> int:
        """The full chunks a hit of ``st``'s prompt may end at: all of them, or for a state model
        the last boundary before its last token (``state_plan.last_boundary``)."""
        if self.states is None:
            return st.prompt_len // self.block_size
        return last_boundary(st.prompt_len, self.block_size)

    def _held(self, st: ReqState, local_tokens: int) -> bool:
        """Whether the local prefix cache (``local_tokens``, block aligned) plus the pool hold every
        full chunk of the prompt the decoder can load (``_load_end``), a state model's state at its
        end too. A failed lookup says no (the decoder then waits as before)."""
        end = self._load_end(st)
        local = local_tokens // self.block_size
        if local >= end:
            return True
        hashes = self.prompt_hashes(st)
        try:
            return self._lookup(hashes[local:end]) == end - local and (
                self.states is None or self.states.held(hashes, end))
        except Exception:
            return False

    def _pool_has_prompt(self, st: ReqState, force: bool = False) -> bool:
        """Throttled: the prompt's last object first (cheap miss), then all of them; for a state
        model what its hit loads, the state first (``_load_end``)."""
        now = time.monotonic()
        if now < st.next_pool_check and not force:
            return False
        st.next_pool_check = now + POOL_POLL_S
        hashes = self.prompt_hashes(st)
        try:
            if self.states is not None:
                end = self._load_end(st)
                return end > 0 and self.states.held(hashes, end) and self._lookup(hashes[:end]) == end
            if not hashes:
                return False
            return self._lookup(hashes[-1:]) == 1 and self._lookup(hashes) == len(hashes)
        except Exception:
            return False

    def _seen_in_pool(self, st: ReqState, force: bool = False) -> Outcome | None:
        """The prefiller commits before it answers, and its answer reaches us three HTTP hops
        later: a prompt already whole in the pool needs no answer."""
        if not self._pool_has_prompt(st, force):
            return None
        st.t["in_pool"] = time.time()
        st.pool_seen = True  # the load's lookup need not ask again (an eviction meanwhile = load error, recompute)
        return Outcome(True, "ok", time.monotonic() - st.posted_mono)

    def stream_match(self, st: ReqState, num_computed_tokens: int) -> tuple[int, bool]:
        """Streaming PD decoder: the whole prompt but its last token, loaded asynchronously (vLLM
        allocates the blocks and parks the request in ``WAITING_FOR_REMOTE_KVS`` until the workers
        report the receive in ``finished_recving``; blocks that did not arrive are recomputed).

        A recurrent-state model (``states``) restores the state at the hit's end, and vLLM hands
        the prefiller the state at the prompt's last full boundary before its last token only
        (``(n - 1) // block``, as in non-streaming PD, tests/pd/test_pd_gdn.py): the hit ends
        there, before the partial chunk, and the decoder computes the rest of the prompt. The
        state does not exist yet: the receive lands it after the chunks (``stream_recv``)."""
        if st.stream_pending or st.stream_sent:
            return 0, False  # asked again after the receive: vLLM holds what arrived
        hashes = self.prompt_hashes(st)
        if self.states is not None:
            hashes = hashes[:self._load_end(st)]
        n = min(len(hashes) * self.block_size, st.prompt_len - 1) - num_computed_tokens
        if n <= 0:
            return 0, False
        st.local_computed = num_computed_tokens
        st.load_hashes, st.load_src_tp = hashes, 0
        return n, True

    def _send_streams(self, meta: LayerwiseMeta) -> None:
        """Streaming PD: tell the workers to receive the requests vLLM just parked."""
        pending, self._stream_pending = self._stream_pending, []
        for st in pending:
            if st.load is None or not st.stream_pending:
                continue
            first, n = st.load
            st.load, st.stream_pending, st.stream_sent = None, False, True
            hashes = st.load_hashes
            if n > 0 and first + n <= min(len(hashes), len(st.block_ids)):
                x = self.groups.xfer(st, hashes, first, first + n)
                meta.stream_loads.append(msgspec.structs.replace(x, holds=True) if st.first_from_prefill else x)
                st.t.setdefault("stream_sent", time.time())
                st.last_xfer_build = self._build
                self._streams[st.req.request_id] = st
            else:  # cannot happen (vLLM allocated the promised blocks); never park a request for good
                raise RuntimeError(f"lw-vllm: {st.req.request_id}: streaming load of chunks {first}+{n} "
                                   f"but {len(st.block_ids)} blocks and {len(hashes)} hashes")

    def _pass_stream_answers(self, meta: LayerwiseMeta) -> None:
        """Streaming PD: the metaserver's answer goes to the receive. An error (the prefill failed)
        ends it now instead of at its deadline; an ok (the prefiller committed what it saved) ends
        it once what is in the pool has landed, the chunks never reserved nor committed failing at
        once; a request continuing from the prefill's first token takes it first (its receive
        holds until this answer reaches it). vLLM recomputes what did not arrive."""
        if self.metaserver is None:
            return
        for rid, st in list(self._streams.items()):
            out = self.metaserver.poll(rid)
            if out is None:
                continue
            del self._streams[rid]  # answered: nothing more to watch
            if out.ok:
                if st.first_from_prefill:
                    self._continue_from_prefill(st, out)
                meta.stream_prefilled.append(rid)
                st.t.setdefault("prefilled", time.time())
            else:
                meta.stream_cancels.append(rid)
                st.t.setdefault("prefill_failed", time.time())
                log.warning("lw-vllm: %s: remote prefill failed (%s); ending its streaming receive, "
                            "computing what did not arrive", rid, out.detail)

    def remote_prefill(self, st: ReqState, local_tokens: int) -> bool | None:
        """PD decoder: ``None`` while the prefill is not there yet, else whether this request is a
        remote-prefill one (which loads whatever the pool holds, whatever the outcome)."""
        if self.metaserver is None:
            return False
        req = st.req
        if st.remote is None:
            params = remote_prefill_params(getattr(req, "kv_transfer_params", None))
            if params is None:
                return False
            if not isinstance(params, str):
                refused = self.metaserver.allow.why_refused(params.metaserver)
                if refused is not None:  # never called: the request is computed here
                    self.metrics.add(pd_metaserver_refused=1)
                    params = (f"kv_transfer_params.metaserver={params.metaserver[:200]!r} is not allowed ({refused}; "
                              "kv_connector_extra_config.pd_allowed_metaservers lists the proxies this engine calls)")
            if isinstance(params, str):
                self._log_refused(req.request_id, params)
                st.remote = RemotePrefill(RemotePhase.BAD_PARAMS, error=params)
                return True
            if params.lw_prefilled:
                # The proxy continues a prefill that answered: nothing to wait for or to tell it.
                st.prefilled_tail = min(params.lw_prefilled, st.prompt_len - 1)
                st.remote = RemotePrefill(RemotePhase.PREFILLED)
                return True
            skip = getattr(req, "skip_reading_prefix_cache", False)
            # Nothing to wait for: no full chunk, or (a state model) no boundary before the last token.
            short = st.prompt_len // self.block_size == 0 or self._load_end(st) == 0
            held = not skip and not short and self._held(st, local_tokens)
            streams = self.cfg.pd_streaming and st.parent is not None
            # Only a request that waits for the answer, or whose receive holds for it, can take its
            # first token from it.
            first = self.forces_first and params.lw_first_token and not (short or skip or held)
            # Post even when this request will not wait: the proxy dispatches the prefill only once
            # every child of the parent has called.
            self.metaserver.post(req.request_id, params, needs_prefill=not (held or short),
                                 forces_first=first or None)
            st.first_from_prefill = first
            st.t["posted"] = time.time()
            st.posted_mono = time.monotonic()
            if short or skip:
                st.remote = RemotePrefill(RemotePhase.NOTHING_TO_LOAD)
                return True
            if held:
                st.remote = RemotePrefill(RemotePhase.POOL_HOLDS_PROMPT)
                return True
            if streams:
                st.remote = RemotePrefill(RemotePhase.STREAMING)
                return True
            st.remote = RemotePrefill(RemotePhase.WAITING)
        if st.remote.waiting:
            out = self.metaserver.poll(req.request_id)
            # A request continuing from the prefill's first token waits for the answer that
            # carries it; others start as soon as the pool holds the prompt.
            if out is None and not st.first_from_prefill:
                out = self._seen_in_pool(st)
            if out is None and self._last_step_empty and self._idle_waited_at != self._build:
                self._idle_waited_at = self._build
                deadline = time.monotonic() + IDLE_WAIT_S
                while out is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    other = self.metaserver.wait_for_answer(min(POOL_POLL_S, left))
                    out = self.metaserver.poll(req.request_id)
                    if out is None and not st.first_from_prefill:
                        out = self._seen_in_pool(st, force=True)
                    if other:  # some call completed: let this scheduling pass handle it
                        break
            if out is None:
                return None
            st.remote.answer(out)
            st.t["seen"] = time.time()
            if "posted" in st.t:
                st.t["answered"] = st.t["posted"] + out.wait_s
            self.metrics.observe("metaserver_wait_s", [out.wait_s])
            if not out.ok:
                log.warning("lw-vllm: %s: remote prefill unavailable (%s); computing what the pool lacks",
                            req.request_id, out.detail)
            elif st.first_from_prefill:
                self._continue_from_prefill(st, out)
        return True

    def _continue_from_prefill(self, st: ReqState, out: Outcome) -> None:
        """The answer's first token becomes the request's (``first_token.force_first``) when it is
        the prefill of this very prompt (``prompt_digest``) and the request has generated nothing."""
        req = st.req
        if out.first_token is None or out.prompt_digest is None or req.num_output_tokens:
            return
        if out.prompt_digest != prompt_digest(prompt_tokens(req)):
            log.warning("lw-vllm: %s: the metaserver's first token follows another prompt (digest %s); "
                        "this decoder computes its own", req.request_id, out.prompt_digest)
            return
        first_token.force_first(req, out.first_token)
        st.t["first_from_prefill"] = time.time()
