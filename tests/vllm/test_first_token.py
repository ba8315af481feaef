"""``lw_vllm.pd.first_token.FirstTokenProcessor`` driven as vLLM's input batch drives it: rows join,
move and leave through ``BatchUpdate``; a row whose request carries the argument and has no output
keeps only that token's logit, whatever the sampling; every other row is untouched."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-vllm.sh)")
pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from lw_vllm.pd.first_token import FIRST_TOKEN_ARG, FirstTokenProcessor, forced_token  # noqa: E402

VOCAB = 8


def _params(token: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.7, extra_args=None if token is None else {FIRST_TOKEN_ARG: token})


def _update(proc: FirstTokenProcessor, size: int, added=(), removed=(), moved=()) -> None:
    proc.update_state(BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved)))


def _finite(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits]


def test_rows_asking_for_a_first_token_keep_only_it_until_they_have_one() -> None:
    proc = FirstTokenProcessor(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    out0: list[int] = []
    out2: list[int] = []
    _update(proc, 3, added=[(0, _params(5), [1, 2], out0), (1, _params(), [1], []), (2, _params(3), [4], out2)])
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    got = proc.apply(logits)
    assert _finite(got) == [[5], list(range(VOCAB)), [3]]
    assert got[0, 5] == before[0, 5] and torch.equal(got[1], before[1])
    assert int(torch.argmax(got[0])) == 5 and int(torch.multinomial(torch.softmax(got[2], -1), 1)) == 3
    out0.append(5)  # row 0 sampled its first token; vLLM appends to the same list
    _update(proc, 3, moved=[(2, 0, MoveDirectionality.SWAP)])  # rows 0 and 2 swap
    assert _finite(proc.apply(torch.randn(3, VOCAB))) == [[3], list(range(VOCAB)), list(range(VOCAB))]
    _update(proc, 2, removed=[0])
    assert _finite(proc.apply(torch.randn(3, VOCAB))) == [list(range(VOCAB))] * 3


def test_a_token_already_masked_or_past_the_vocabulary_leaves_the_row_alone() -> None:
    proc = FirstTokenProcessor(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    _update(proc, 2, added=[(0, _params(2), [1], []), (1, _params(VOCAB + 3), [1], [])])
    logits = torch.randn(2, VOCAB)
    logits[0, 2] = float("-inf")  # a constraint of the decoder excludes it
    assert _finite(proc.apply(logits)) == [[i for i in range(VOCAB) if i != 2], list(range(VOCAB))]


def test_params_name_the_field_and_the_accepted_values() -> None:
    assert forced_token(_params(4)) == 4 and forced_token(_params()) is None
    FirstTokenProcessor.validate_params(_params(4))
    for bad in (-1, "3", 2.0, True):
        with pytest.raises(ValueError, match=f"extra_args.{FIRST_TOKEN_ARG}=.*accepted: a token id"):
            FirstTokenProcessor.validate_params(SamplingParams(extra_args={FIRST_TOKEN_ARG: bad}))
