import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lw_core.plan import ObjectLayout, ReqLoad, ReqSave, StepPlan, flatten, split_batches, stagger_delay_us


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 500), st.integers(1, 1 << 20), st.integers(0, 64), st.integers(0, 1 << 24))
def test_batches_respect_limits_and_lose_nothing(n, item, max_blocks, max_bytes):
    batches = split_batches(n, item, max_blocks, max_bytes)
    flat = [i for b in batches for i in b]
    assert flat == list(range(n))  # nothing lost, nothing duplicated, order kept
    for b in batches:
        assert len(b) >= 1
        if max_blocks:
            assert len(b) <= max_blocks
        if max_bytes and item <= max_bytes:
            assert len(b) * item <= max_bytes
        if max_bytes and item > max_bytes:
            assert len(b) == 1  # an oversize block still travels, alone
    if not max_blocks and not max_bytes:
        assert len(batches) == (1 if n else 0)


def test_bad_batch_args():
    with pytest.raises(ValueError):
        split_batches(3, 0)
    with pytest.raises(ValueError):
        split_batches(3, 10, -1)


def test_layout_offsets_layer_major():
    lay = ObjectLayout((100, 200, 300))
    assert lay.offsets == (0, 100, 300) and lay.nbytes == 600 and lay.num_layers == 3
    with pytest.raises(ValueError):
        ObjectLayout(())


def test_stagger():
    assert stagger_delay_us(0, 1, 4, 2) == 0
    assert stagger_delay_us(100, 0, 1, 5) == 0
    assert [stagger_delay_us(100, r, 4, 1) for r in range(4)] == [100, 200, 300, 0]


def test_plan_roundtrips_through_msgpack_and_flattens():
    plan = StepPlan(loads=[ReqLoad("a", ["k1", "k2"], [3, 4]), ReqLoad("b", ["k3"], [9])], saves=[ReqSave("c", ["k4"], [1])])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan)
    assert back == plan
    assert flatten(back.loads) == (["k1", "k2", "k3"], [3, 4, 9], ["a", "a", "b"])
    with pytest.raises(ValueError):
        flatten([ReqLoad("x", ["k"], [])])
