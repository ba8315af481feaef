"""``--continue-after-prefill`` (with ``--prefill-first`` and early dispatch, all defaults): an
answer that is not streamed is continued by the decoder after its prefill answered.

A non-streamed client waits for the whole answer, so relaying the prefill's first token gains it
nothing; what costs time is the decoder reaching that token itself. On the decoder's path it waits
for the metaserver answer that carries the token, then spends a whole step computing the prompt's
last token only to produce it (``lw_vllm.pd.first_token``). Here the proxy sends the prefill alone
and, once it answered, sends the decoder each choice's prompt token ids plus that choice's first
token, marked ``lw_prefilled`` (``lw_core.wire.DecodeTransferParams``): the decoder loads the
prefill's prompt from the pool at once, calls no metaserver, and its first step computes the token
after the prefill's. The answer is the prefill's, each choice spliced with its continuation's
(``recompute.splice``: text, token ids, log-probs, finish and stop reasons); usage adds the
continuations' generated tokens to the prefill's.

What a single engine would answer, for the requests this applies to (``applies``):

- greedy requests token for token, the first token's log-prob entry the prefiller's (computed over
  the whole prompt, as a single engine does); sampled requests without a ``seed`` with the same
  distribution (the first token drawn by the prefiller, the rest by the decoder given it). A seeded
  sampled request keeps the decoder's path, where the decoder draws the first token again from the
  same generator state and so reproduces a single engine's seeded answer exactly;
- the text: vLLM's detokenizer primes itself with the prompt, so the continuation's text is what a
  single engine appends after the first token's (a first token that is part of a UTF-8 character
  included: the continuation's prompt holds its bytes).

Kept on the decoder's path, because the continuation would see the first token as part of its
prompt where a single engine sees it as output: stop strings (one could begin in the first token's
text and end in the next), ``presence_penalty`` and ``frequency_penalty`` (they count output tokens),
``bad_words``, structured outputs and ``response_format`` other than text (the grammar would start
again after the first token), custom logits processors (``logits_processors``, ``vllm_xargs``),
``min_tokens``, beam search, and whatever the streamed relay leaves out (several prompts, ``echo``,
``suffix``, prompt log-probs; chat: ``tools``, ``functions``, ``return_prompt_text``,
``continue_final_message``, messages with anything but text, whose token ids vLLM does not take).
A chat whose first token the prefiller put into ``reasoning_content`` or ``tool_calls`` also keeps
it (``plan``: the continuation's parsers would not see the block open), as does any answer without
the first tokens' and the prompt's ids. Those requests go to the decoder with the parent whose
prefill already answered, so nothing is computed twice.
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import recompute as rc
from .relay import EXCLUDED, EXCLUDED_CHAT, continues, first_tokens_of, given, greedy, request_id
from .validate import ClientRequest

# Fields whose effect depends on what the request generated so far, or that change how the prompt
# is built: with any of them given (not null or false) the answer keeps the decoder's path.
EXCLUDED_CONTINUED = ("bad_words", "logits_processors", "vllm_xargs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "structural_tag", "structured_outputs", "use_beam_search",
                  "continue_final_message", "prompt_embeds")
_PENALTIES = ("presence_penalty", "frequency_penalty")


def applies(req: ClientRequest, prefill_first: bool) -> bool:
    """Whether a request's answer is continued after its prefill (see the module docstring)."""
    b = req.body
    if req.stream or not prefill_first or req.prompt_ids is not None or not continues(req):
        return False
    if any(given(b.get(k)) for k in (*(EXCLUDED_CHAT if req.chat else EXCLUDED), *EXCLUDED_CONTINUED)):
        return False
    stop = b.get("stop")
    if stop is not None and stop != [] and stop != "":
        return False
    rf = b.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        return False
    for k in _PENALTIES:
        v = b.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != 0):
            return False
    if b.get("seed") is not None and not greedy(req):
        return False
    return not req.chat or all(isinstance(m.get("content"), str) for m in b["messages"])


class Plan(msgspec.Struct):
    """The prefill's answer (``answer``, parsed) and, per choice index, the request continuing it
    (choices the prefill ended: EOS, a stop token, or ``max_tokens`` 1, need none)."""

    answer: dict[str, Any]
    continuations: dict[int, ClientRequest]


def plan(req: ClientRequest, data: bytes) -> Plan | None:
    """How to finish ``req`` from its prefill's 200 answer ``data``; None when it cannot be
    continued (the decoder's path then): a choice without its first token's and the prompt's ids, a
    chat whose first token went to reasoning or a tool call."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    firsts = first_tokens_of(obj, req.chat)
    chs = obj.get("choices") if isinstance(obj, dict) else None
    if (not isinstance(chs, list) or not all(isinstance(ch, dict) for ch in chs)
            or sorted(ch.get("index", -1) for ch in chs) != list(range(req.n))):
        return None
    conts: dict[int, ClientRequest] = {}
    for ch in chs:
        i = ch["index"]
        if ch.get("finish_reason") != "length":
            continue  # the prefill ended this choice (EOS, a stop token): it is whole
        if firsts is None or i not in firsts[0]:
            return None
        if req.chat:
            msg = ch.get("message")
            if not isinstance(msg, dict) or msg.get("tool_calls") or msg.get("reasoning_content") or msg.get("reasoning"):
                return None
        cont = rc.continuation(req, i, rc.choice_text(ch, req.chat), [firsts[0][i]], 1, firsts[1])
        if cont is not None:
            cont.prefilled = 1
            conts[i] = cont
    return Plan(obj, conts)


def assemble(p: Plan, parent_id: str, chat: bool, answers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The client's answer: the prefill's, named as the relayed streams are (``relay.request_id``),
    each continued choice spliced with its continuation's answer (``answers``, parsed)."""
    obj = p.answer
    obj["id"] = f"{'chatcmpl' if chat else 'cmpl'}-{request_id(parent_id)}"
    if "kv_transfer_params" in obj:
        obj["kv_transfer_params"] = None  # a single engine's, where no connector answers
    usage = obj.get("usage")
    for ch in obj["choices"]:
        more = answers.get(ch["index"])
        if more is None:
            continue
        rc.splice(ch, (more.get("choices") or [{}])[0], chat)
        rc.add_usage(usage, more.get("usage"))
    return obj
