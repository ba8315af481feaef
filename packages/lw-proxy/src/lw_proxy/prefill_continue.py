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
  the whole prompt, as a single engine does); sampled requests with the same distribution, and a
  seeded one token for token too: the prefiller draws the first token with the request's seed (choice
  ``i`` of ``n`` with ``seed + i``, as vLLM seeds it on every engine, and so does its continuation
  here), and lw-vllm sets a continuation's generator one draw ahead, where a single engine's is
  after the first token (``lw_vllm.pd.seeded_continuation``);
- the text: vLLM's detokenizer primes itself with the prompt, so the continuation's text is what a
  single engine appends after the first token's (a first token that is part of a UTF-8 character
  included: the continuation's prompt holds its bytes).

Stop strings: vLLM looks for them in the output text only, so a stop string that begins in the
first token's text and ends after it would be missed by the continuation; ``plan`` keeps on the
decoder's path each answer whose first token's text ends with a proper prefix of one of them
(``could_cross``), and continues the rest, whose stops the decoder finds where a single engine does.

``min_tokens``: the prefill asks at most one (``relay.prefill_min_tokens``), so its first token is
never EOS or a stop token where a single engine's is not, and the continuation asks one fewer than
the client (``recompute.continuation``): vLLM masks EOS and the stop tokens, and looks for stop
strings, by the count of output tokens, which the continuation starts after the first token.

Kept on the decoder's path, because the continuation would see the first token as part of its
prompt where a single engine sees it as output: ``presence_penalty`` and ``frequency_penalty``
(they count output tokens), ``bad_words``, structured outputs and ``response_format`` other than text (the grammar would start
again after the first token), custom logits processors (``logits_processors``, ``vllm_xargs``),
beam search, and whatever the streamed relay leaves out (but several prompts: a completion's list
of prompts is continued choice by choice, ``prompt_list``), an
``echo`` it does not put in itself (``relay.echo_ok``: a completion's on one text prompt without
log-probs is continued, its answer beginning with the prompt's text), ``suffix``, prompt log-probs; chat: ``tools``, ``functions``, ``return_prompt_text``,
``continue_final_message``, messages with anything but text, whose token ids vLLM does not take).
A chat whose first token a reasoning parser saw (``reasoning`` or ``reasoning_content`` not null,
an empty one included: a block opened) or that went to ``tool_calls`` also keeps it (``plan``: the
continuation's parsers would not see the block open), as does any chat a server with a reasoning
parser answered (its usage has ``completion_tokens_details``: a block the first token's text does
not show may still close later, which the continuation's parser would not know), and any answer without the first tokens'
and the prompt's ids. Those requests go to the decoder with the parent whose prefill already
answered, so nothing is computed twice.
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import recompute as rc
from .relay import (
    EXCLUDED,
    EXCLUDED_CHAT,
    asks_logprobs,
    continues,
    continuous_usage,
    echo_ok,
    eligible,
    first_tokens_of,
    given,
    held_back,
    plain_content,
    prefill_min_tokens,
    reasoning_usage,
    request_id,
    stop_strings,
)
from .validate import ClientRequest

# Fields whose effect depends on what the request generated so far, or that change how the prompt
# is built: with any of them given (not null or false) the answer keeps the decoder's path.
EXCLUDED_CONTINUED = ("bad_words", "logits_processors", "vllm_xargs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "structural_tag", "structured_outputs", "use_beam_search",
                  "continue_final_message", "prompt_embeds")
_PENALTIES = ("presence_penalty", "frequency_penalty")


def prompt_list(req: ClientRequest) -> bool:
    """A completion of several prompts: its prefill (one request of every prompt, with the client's
    ``n``) answers each choice of each prompt, each continued on its own (a request of that prompt's
    ids plus that choice's first token; choice ``j`` of each prompt with ``seed + j``, as vLLM seeds
    it on every engine)."""
    return not req.chat and len(req.prompts) > 1 and (req.body.get("best_of") or 1) == 1


def applies(req: ClientRequest, prefill_first: bool) -> bool:
    """Whether a request's answer is continued after its prefill (see the module docstring)."""
    if req.stream or not prefill_first or req.prompt_ids is not None:
        return False
    return (continues(req) or prompt_list(req)) and _continuable(req)


def applies_stream(req: ClientRequest) -> bool:
    """Whether a stream is continued after its prefill (``sse_relay``): one choice of one prompt
    that the relay may open (``relay.eligible``), and what ``applies`` asks of an answer that is
    not streamed, but not where the continuation's events would differ from a single engine's:
    continuous usage (each event's counts would be the continuation's), stop strings vLLM holds
    text back for (it holds back the continuation's own text, not across the first token), a
    completion's log-probs (their ``text_offset`` count from the continuation's start)."""
    return (req.stream and req.prompt_ids is None and req.children == 1 and eligible(req)
            and continuous_usage(req) is False and held_back(req) == 0
            and (req.chat or not asks_logprobs(req)) and _continuable(req))


def _continuable(req: ClientRequest) -> bool:
    b = req.body
    if prefill_min_tokens(req) is None:
        return False
    if any(given(b.get(k)) for k in (*(EXCLUDED_CHAT if req.chat else EXCLUDED), *EXCLUDED_CONTINUED)):
        return False
    if not echo_ok(req):
        return False
    if stop_strings(req) is None:
        return False
    rf = b.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        return False
    for k in _PENALTIES:
        v = b.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != 0):
            return False
    return not req.chat or all(isinstance(m.get("content"), str) for m in b["messages"])


class Plan(msgspec.Struct):
    """The prefill's answer (``answer``, parsed) and, per choice index, the request continuing it
    (choices the prefill ended: EOS, a stop token, or ``max_tokens`` 1, need none)."""

    answer: dict[str, Any]
    continuations: dict[int, ClientRequest]


def plan(req: ClientRequest, data: bytes) -> Plan | None:
    """How to finish ``req`` from its prefill's 200 answer ``data``; None when it cannot be
    continued (the decoder's path then): a choice without its first token's and its prompt's ids, a
    chat whose first token went to reasoning or a tool call, a first token's text a stop string
    could begin in (``could_cross``). A completion's choices each carry their prompt's ids (a
    prompt list's differ), a chat's answer once."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if req.chat and reasoning_usage(obj):
        return None  # a reasoning parser's server: the continuation's parser would not see the first token
    firsts = first_tokens_of(obj, req.chat)
    stops = stop_strings(req) or []
    seed = req.body.get("seed")
    chs = obj.get("choices") if isinstance(obj, dict) else None
    if (not isinstance(chs, list) or not all(isinstance(ch, dict) for ch in chs)
            or sorted(ch.get("index", -1) for ch in chs) != list(range(req.children))):
        return None
    conts: dict[int, ClientRequest] = {}
    for ch in chs:
        i = ch["index"]
        if ch.get("finish_reason") != "length":
            continue  # the prefill ended this choice (EOS, a stop token): it is whole
        if firsts is None or i not in firsts[0]:
            return None
        first = plain_content(ch.get("message")) if req.chat else rc.choice_text(ch, False)
        if first is None:
            return None  # a reasoning parser saw it (an empty reasoning too: a block opened), or a tool call
        if could_cross(first, stops):
            return None
        pids = firsts[1] if req.chat else ch.get("prompt_token_ids")
        if not isinstance(pids, list) or not pids or not all(type(t) is int for t in pids):
            return None
        cont = rc.continuation(req, i, rc.echo_prefix(req, i) + first, [firsts[0][i]], 1, pids)
        if cont is not None:
            cont.prefilled = 1
            if type(seed) is int and req.n > 1:  # vLLM seeds choice j of each prompt with seed + j
                cont.body["seed"] = seed + i % req.n
            conts[i] = cont
    return Plan(obj, conts)


def could_cross(first: str, stops: list[str]) -> bool:
    """Whether a stop string could begin in the first token's text ``first`` and end after it: some
    non-empty proper prefix of it ends ``first``. vLLM looks for stop strings in a request's output
    text only, each time at the text just added (``vllm.v1.engine.detokenizer.check_stop_strings``),
    so the continuation, whose output starts after ``first``, finds every stop a single engine
    finds after the first token except those; a stop wholly inside ``first`` ended the prefill."""
    return any(first.endswith(s[:k]) for s in stops for k in range(1, min(len(s) - 1, len(first)) + 1))


def assemble(p: Plan, parent_id: str, chat: bool, answers: dict[int, dict[str, Any]],
             echo: str | None = None) -> dict[str, Any]:
    """The client's answer: the prefill's, named as the relayed streams are (``relay.request_id``),
    each continued choice spliced with its continuation's answer (``answers``, parsed); with
    ``echo`` (``relay.echo_text``; the prefill echoed nothing) each choice's text begins with it."""
    obj = p.answer
    obj["id"] = f"{'chatcmpl' if chat else 'cmpl'}-{request_id(parent_id)}"
    if "kv_transfer_params" in obj:
        obj["kv_transfer_params"] = None  # a single engine's, where no connector answers
    usage = obj.get("usage")
    for ch in obj["choices"]:
        if echo:
            ch["text"] = echo + (ch.get("text") or "")
        more = answers.get(ch["index"])
        if more is None:
            continue
        rc.splice(ch, (more.get("choices") or [{}])[0], chat)
        rc.add_usage(usage, more.get("usage"))
    return obj
