"""A Backend wrapper that fails or stalls chosen calls by rule (test suite only, never production).

A rule (dict, JSON-friendly so a test can hand it to an engine subprocess)::

    {"op": "read", "layer": 2, "action": "fail", "times": 1, "skip": 0, "phases": [1]}

* ``op``: lookup, open, read, reserve, write, commit, release, abort, or "*" (any of them).
  ``read`` also covers zero-copy ``view`` of a committed object and ``write`` the ``view`` of a
  reserved one, so a rule applies whichever path the pipeline takes.
* ``layer``: only reads/writes of that layer (objects are layer-major: layer = offset // length).
* ``objects``: "state": only calls naming a recurrent-state object's key (lookup, reserve, open);
  the keys are told apart by ``state_marks`` (substrings of their key space, which the engine
  runner sets from the connector's: ``lw_dev.engine``).
* ``action``: "fail" raises ``error`` (BackendUnavailable by default, or BackendError /
  ObjectMissing / PoolFull, or RuntimeError for a programming-error-like crash); "stall" sleeps
  ``seconds`` and then performs the call.
* ``times``: how many matching calls it hits (default: all); ``skip``: matching calls let through
  first; ``phases``: only while ``FaultyBackend.phase`` is one of these (default: always).

``hits`` counts, per rule index, how often it fired (tests assert the fault really happened).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing, PoolFull

OPS = ("lookup", "open", "read", "reserve", "write", "commit", "release", "abort")
ACTIONS = ("fail", "stall")
ERRORS = {"unavailable": BackendUnavailable, "error": BackendError, "missing": ObjectMissing,
          "full": PoolFull, "crash": RuntimeError}
_KEYS = {"op", "layer", "action", "seconds", "times", "skip", "phases", "error", "objects"}
KEYED_OPS = ("lookup", "reserve", "open")  # the calls that name keys


def check_rule(rule: dict[str, Any]) -> dict[str, Any]:
    unknown = set(rule) - _KEYS
    if unknown:
        raise ValueError(f"fault rule: unknown keys {sorted(unknown)}; accepted: {sorted(_KEYS)}")
    if rule.get("op") not in OPS + ("*",):
        raise ValueError(f"fault rule: op={rule.get('op')!r}; accepted: {OPS + ('*',)}")
    if rule.get("action", "fail") not in ACTIONS:
        raise ValueError(f"fault rule: action={rule.get('action')!r}; accepted: {ACTIONS}")
    if rule.get("error", "unavailable") not in ERRORS:
        raise ValueError(f"fault rule: error={rule.get('error')!r}; accepted: {sorted(ERRORS)}")
    if "objects" in rule:
        if rule["objects"] != "state":
            raise ValueError(f"fault rule: objects={rule['objects']!r}; accepted: 'state'")
        if rule.get("op") not in KEYED_OPS:
            raise ValueError(f"fault rule: objects needs an op naming keys, got op={rule.get('op')!r}; "
                             f"accepted: {KEYED_OPS}")
    return rule


class FaultyBackend:
    def __init__(self, inner: Any, rules: Sequence[dict[str, Any]] = (), *, layer_nbytes: int | None = None) -> None:
        self.inner = inner
        self.name = f"faulty({getattr(inner, 'name', type(inner).__name__)})"
        self.rules = [check_rule(dict(r)) for r in rules]
        self.layer_nbytes = layer_nbytes
        self.state_marks: tuple[str, ...] = ()  # substrings naming recurrent-state keys (rule "objects")
        self.phase = 0
        self.hits = [0] * len(self.rules)
        self._seen = [0] * len(self.rules)
        self._lock = threading.Lock()
        self._reserved: set[int] = set()  # id() of handles we handed out for writing

    def set_rules(self, rules: Sequence[dict[str, Any]]) -> None:
        checked = [check_rule(dict(r)) for r in rules]
        if any("objects" in r for r in checked) and not self.state_marks:
            raise ValueError("fault rule: objects='state', but no state key space is known (state_marks: "
                             "a model whose recurrent states the pool restores, run by lw_dev.engine)")
        with self._lock:
            self.rules = checked
            self.hits = [0] * len(self.rules)
            self._seen = [0] * len(self.rules)

    # --- rule matching ---
    def _layer(self, offset: int, length: int) -> int:
        n = self.layer_nbytes or length
        return offset // n if n else 0

    def _fire(self, op: str, layers: Sequence[int] = (), keys: Sequence[str] = ()) -> None:
        todo = []
        with self._lock:
            for i, r in enumerate(self.rules):
                if r["op"] not in (op, "*"):
                    continue
                if "layer" in r and r["layer"] not in layers:
                    continue
                if "objects" in r and not any(m in k for k in keys for m in self.state_marks):
                    continue
                if "phases" in r and self.phase not in r["phases"]:
                    continue
                self._seen[i] += 1
                if self._seen[i] <= r.get("skip", 0):
                    continue
                if "times" in r and self.hits[i] >= r["times"]:
                    continue
                self.hits[i] += 1
                todo.append(r)
        for r in todo:
            if r.get("action", "fail") == "stall":
                time.sleep(float(r.get("seconds", 1.0)))
            else:
                where = f" (layer {r['layer']})" if "layer" in r else ""
                raise ERRORS[r.get("error", "unavailable")](f"injected fault: {op}{where} failed")

    # --- Backend protocol ---
    def lookup(self, keys: Sequence[str]) -> int:
        self._fire("lookup", keys=keys)
        return self.inner.lookup(keys)

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[Any]:
        self._fire("reserve", keys=keys)
        hs = self.inner.reserve(keys, nbytes)
        with self._lock:
            self._reserved.update(id(h) for h in hs if h is not None)
        return hs

    def _forget(self, handles: Sequence[Any]) -> None:
        with self._lock:
            self._reserved.difference_update(id(h) for h in handles)

    def write(self, handles: Sequence[Any], offsets: Sequence[int], srcs: Sequence[Any]) -> None:
        self._fire("write", sorted({self._layer(o, memoryview(s).nbytes) for o, s in zip(offsets, srcs)}))
        self.inner.write(handles, offsets, srcs)

    def commit(self, handles: Sequence[Any]) -> None:
        self._fire("commit")
        self.inner.commit(handles)
        self._forget(handles)

    def abort(self, handles: Sequence[Any]) -> None:
        self._forget(handles)
        self._fire("abort")
        self.inner.abort(handles)

    def open(self, keys: Sequence[str]) -> list[Any]:
        self._fire("open", keys=keys)
        return self.inner.open(keys)

    def read(self, handles: Sequence[Any], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        self._fire("read", sorted({self._layer(o, memoryview(d).nbytes) for o, d in zip(offsets, dsts)}))
        self.inner.read(handles, offsets, dsts)

    def release(self, handles: Sequence[Any]) -> None:
        self._fire("release")
        self.inner.release(handles)

    def view(self, handle: Any, offset: int, nbytes: int) -> memoryview | None:
        # A view of a reserved object is where a write lands; of a committed one, a read.
        with self._lock:
            op = "write" if id(handle) in self._reserved else "read"
        self._fire(op, [self._layer(offset, nbytes)])
        return self.inner.view(handle, offset, nbytes)

    def intact(self, handles: Any) -> list[bool]:
        intact = getattr(self.inner, "intact", None)
        return intact(handles) if intact is not None else [True] * len(handles)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # backend extras (verify, ...) pass through
        return getattr(self.inner, name)

