"""The first-token fields of the PD wire (lw_core.wire): the metaserver answer carries a token id and
the digest of the prompt it followed, both checked when decoded; a decoder's older answer shape
(``{"status": "ok"}``) still decodes, with neither."""

from __future__ import annotations

import msgspec
import pytest

from lw_core.wire import MetaserverResponse, prompt_digest


def test_the_digest_names_the_prompt_and_its_order() -> None:
    d = prompt_digest([1, 2, 3])
    assert len(d) == 32 and int(d, 16) >= 0
    assert d == prompt_digest([1, 2, 3]) and d != prompt_digest([3, 2, 1]) and d != prompt_digest([1, 2, 3, 0])
    assert prompt_digest([]) != prompt_digest([0])


def test_answers_decode_with_checked_fields() -> None:
    dec = msgspec.json.Decoder(MetaserverResponse)
    assert dec.decode(b'{"status":"ok"}') == MetaserverResponse()
    ok = MetaserverResponse(first_token=7, prompt_digest=prompt_digest([5, 6]))
    assert dec.decode(msgspec.json.encode(ok)) == ok
    for bad in (b'{"status":"ok","first_token":-1}', b'{"status":"ok","first_token":2147483648}',
                b'{"status":"ok","prompt_digest":"XYZ"}', b'{"status":"ok","first_token":"7"}'):
        with pytest.raises(msgspec.ValidationError):
            dec.decode(bad)
