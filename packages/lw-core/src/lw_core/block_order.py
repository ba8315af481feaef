"""How heads and tokens are ordered in the bytes of one block of one layer of GQA KV.

A block holds ``heads x tokens`` rows of ``row`` bytes each (one head's K and V for one token: the
content dim is innermost in every layout vLLM resolves). Two orders occur:

* ``HEAD_MAJOR`` ("HN"): ``[heads, tokens, row]``. vLLM's CPU layout (``LBHNC``) and every layout
  with the head dim outside the token dim. One head of a block is one contiguous byte range.
* ``TOKEN_MAJOR`` ("NH"): ``[tokens, heads, row]``. vLLM's default on CUDA (``LBNHC``, chosen when
  no attention backend declares its layouts: FlashAttention, Triton). One head of a block is
  ``tokens`` ranges of ``row`` bytes, ``heads * row`` apart.

A block of one head (``ONE_HEAD``, "N": MLA, or GQA with one kv head per rank) is the same bytes
in both orders; ``canonical`` names it so, so such engines share objects whatever their layout.
The order is part of every key (``layout_fp``): engines whose blocks order heads and tokens
differently never read each other's objects. The TP split (``lw_core.tp_split``) computes its
byte ranges for either order with ``row_offset``.
"""

from __future__ import annotations

from typing import Final, Literal

BlockOrder = Literal["HN", "NH"]
HEAD_MAJOR: Final = "HN"
TOKEN_MAJOR: Final = "NH"
ONE_HEAD: Final = "N"
ORDERS: tuple[str, ...] = (HEAD_MAJOR, TOKEN_MAJOR)


def check_order(order: str) -> BlockOrder:
    """``order`` if it is one of ``ORDERS``, else ``ValueError`` naming the accepted values."""
    if order == HEAD_MAJOR:
        return HEAD_MAJOR
    if order == TOKEN_MAJOR:
        return TOKEN_MAJOR
    raise ValueError(f"block order {order!r} is not one of {list(ORDERS)} (head-major, token-major)")


def canonical(order: str, heads: int) -> str:
    """The order as keys name it: ``ONE_HEAD`` for a block of one head, else ``order``."""
    check_order(order)
    if heads < 1:
        raise ValueError(f"heads={heads} must be >= 1")
    return ONE_HEAD if heads == 1 else order


def row_offset(order: BlockOrder, heads: int, tokens: int, head: int, token: int, row: int) -> int:
    """Byte offset of ``(head, token)``'s row in a block of ``heads x tokens`` rows of ``row`` bytes."""
    return (head * tokens + token) * row if order == HEAD_MAJOR else (token * heads + head) * row
