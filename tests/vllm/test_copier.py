"""TorchCopier on CPU: opaque whole-block moves for every KV layout vLLM hands over."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lw_core.pipeline.copier import Copier  # noqa: E402
from lw_vllm.device.copier import TorchCopier, block_bytes_view  # noqa: E402

NB = 6


def _layouts():
    g = torch.Generator().manual_seed(0)
    return {
        "cpu_gqa": torch.randn(NB, 2, 32, 64, generator=g),  # [nb, kv_heads, bs, 2*head_dim]
        "cpu_mla": torch.randn(NB, 1, 16, 576, generator=g),
        "kv_outer": torch.randn(2, NB, 16, 2, 32, generator=g),  # flash-attn style [2, nb, ...]
        "kernel_split": torch.randn(NB * 2, 1, 8, 576, generator=g),  # 2 kernel blocks per block
        "hnd_permuted": torch.randn(NB, 32, 2, 64, generator=g).permute(0, 2, 1, 3),  # stride order view
    }


def _block_bytes(t: torch.Tensor, b: int) -> bytes:
    """Reference bytes of block b, by index arithmetic independent of block_bytes_view."""
    if t.shape[0] == 2 and t.shape[1] == NB:
        return b"".join(t[k, b].contiguous().numpy().tobytes() for k in range(2))
    if t.shape[0] == NB * 2:
        return t[2 * b : 2 * b + 2].contiguous().numpy().tobytes()
    if not t.is_contiguous():  # the permuted view: physical memory is [nb, 32, 2, 64]
        return t.permute(0, 2, 1, 3)[b].contiguous().numpy().tobytes()
    return t[b].contiguous().numpy().tobytes()


@pytest.mark.parametrize("name", list(_layouts()))
def test_round_trip_moves_whole_blocks(name: str) -> None:
    src = _layouts()[name]
    dst = torch.zeros_like(src)
    a, b = TorchCopier([src, src * 2], NB), TorchCopier([dst, dst.clone()], NB)
    assert isinstance(a, Copier)
    n = a.block_nbytes(0)
    assert n == src.numel() * 4 // NB
    ids = [4, 1, 3]
    bufs = [bytearray(n) for _ in ids]
    assert a.from_kv(0, ids, bufs) is None
    for i, blk in zip(ids, bufs):
        assert bytes(blk) == _block_bytes(src, i)
    assert a.wait(b.to_kv(0, [0, 5, 2], bufs), 1.0)
    for i, j in zip(ids, [0, 5, 2]):
        assert _block_bytes(dst, j) == _block_bytes(src, i)
    untouched = {0, 1, 2, 3, 4, 5} - {0, 5, 2}
    for j in untouched:
        assert not any(_block_bytes(dst, j))


def test_kv_views_alias_the_cache() -> None:
    t = torch.zeros(NB, 1, 16, 576)
    c = TorchCopier([t], NB)
    (v,) = c.kv_views(0, [3])
    assert len(v) == c.block_nbytes(0) and not v.readonly
    np.frombuffer(v, dtype=np.float32)[:] = 7.0
    assert torch.all(t[3] == 7.0) and torch.all(t[2] == 0)
    # A block made of two segments (K and V apart) has no single host view.
    assert TorchCopier([torch.zeros(2, NB, 4, 32)], NB).kv_views(0, [0]) is None


def test_bad_input_is_refused_with_the_reason() -> None:
    c = TorchCopier([torch.zeros(NB, 2, 32, 64)], NB)
    n = c.block_nbytes(0)
    with pytest.raises(IndexError, match="block id 6 out of range"):
        c.to_kv(0, [6], [bytes(n)])
    with pytest.raises(ValueError, match=f"expected {n}"):
        c.to_kv(0, [0], [bytes(n - 4)])
    with pytest.raises(ValueError, match="1 block ids but 2 srcs"):
        c.to_kv(0, [0], [bytes(n), bytes(n)])
    with pytest.raises(IndexError, match="layer=1 out of range"):
        c.block_nbytes(1)
    with pytest.raises(NotImplementedError, match="block dimension"):
        block_bytes_view(torch.zeros(5, 3, 7), NB)


def test_cpu_tokens_are_done_at_once() -> None:
    c = TorchCopier([torch.zeros(NB, 1, 16, 576)], NB)
    assert c.compute_event() is None
    assert c.wait(None, 0.001)
    c.make_visible(None)
