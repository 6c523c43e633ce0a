"""The hot commands packed in one format each equal what the general packer sends."""

from __future__ import annotations

import pytest

from celery_redislock.evalsha import Script
from celery_redislock.protocol import native_release, set_nx_get
from celery_redislock.resp import pack_arguments, pack_command

KEYS_AND_VALUES = [
    ("k", "v"),
    ("redislock:app.charge:{6b57147af77fbacbf001bac6c35787bb}", "v1|id|0|h@x|42|n|t|1"),
    ("clé:{ü}", "v1||0|hôte|1|n|nom|2"),  # non-ASCII: lengths are of the encoded bytes
    ("", ""),
]


@pytest.mark.parametrize(("key", "value"), KEYS_AND_VALUES)
@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_the_acquire_and_the_native_release_are_the_commands_the_general_packer_makes(
    key: str, value: str, encoding: str
) -> None:
    if encoding == "latin-1" and not (key + value).isascii():
        key, value = key.encode().decode("latin-1"), value.encode().decode("latin-1")
    for ttl_ms in (1, 30_000, 10**13):
        assert set_nx_get(key, value, ttl_ms, encoding) == pack_command(
            ("SET", key, value, "NX", "PX", ttl_ms, "GET"), encoding
        )
    assert native_release(key, value, encoding) == pack_command(("DELIFEQ", key, value), encoding)


@pytest.mark.parametrize(("key", "value"), KEYS_AND_VALUES)
def test_a_script_call_packs_as_the_general_packer_does(key: str, value: str) -> None:
    script = Script("return 1")
    for keys, args in [((key,), (value,)), ((key,), (value, 7)), ((key, key), ()), ((), (value,))]:
        expected = pack_command(["EVALSHA", script.sha, len(keys), *keys, *args])
        assert script.pack_evalsha(keys, args, "utf-8") == expected
    assert pack_arguments(["x"]) == b"$1\r\nx\r\n"
