"""The bucket table: the default sizes, a table given by `--buckets`, and its checks."""

import subprocess
import sys

import pytest

from jaxserve.config import EngineConfig
from jaxserve.host.buckets import BucketTable, token_sizes


def test_parse_and_choose():
    table = BucketTable.parse("1,8,64:1,8")
    assert (table.token_sizes, table.row_sizes) == ((1, 8, 64), (1, 8))
    assert table.buckets() == [(1, 1), (8, 1), (64, 1), (8, 8), (64, 8)]
    assert table.choose(3, 2) == (8, 8)
    assert table.choose(9, 1) == (64, 1)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("1,8,64", "TOKEN_SIZES:ROW_SIZES"), ("1,x:1", "TOKEN_SIZES:ROW_SIZES"),
     ("8,1:1", "token_sizes must be increasing"), ("1,8:0,4", "row_sizes must be increasing"),
     (":1", "TOKEN_SIZES:ROW_SIZES")],
)
def test_parse_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        BucketTable.parse(spec)


def test_a_given_table_must_hold_a_full_step():
    EngineConfig(max_batch=8, token_budget=64, buckets=((1, 8, 64), (1, 8)))
    with pytest.raises(ValueError, match=r"largest bucket \(64 tokens, 8 rows\) must hold"):
        EngineConfig(max_batch=16, token_budget=64, buckets=((1, 8, 64), (1, 8)))
    with pytest.raises(ValueError, match="token_budget 128"):
        EngineConfig(max_batch=8, token_budget=128, buckets=((1, 8, 64), (1, 8)))


def test_serve_refuses_a_table_that_cannot_hold_a_step():
    done = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--max-batch", "16", "--buckets",
         "1,4:1,2"], capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "must hold a full step: token_budget 256, max_batch 16" in done.stderr


def test_default_token_sizes_double_then_step_through_the_top_octave():
    assert token_sizes(1, 256) == (1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 224, 256)
    assert token_sizes(1, 512)[-5:] == (256, 320, 384, 448, 512)
    assert token_sizes(1, 16) == (1, 2, 4, 8, 16)
    assert token_sizes(1, 100) == (1, 2, 4, 8, 16, 32, 64, 96, 100)
    assert token_sizes(256, 256) == (256,)
    table = BucketTable.for_limits(16, 256)  # a prompt just past 128 pads to 160, not 256
    assert table.choose(150, 1) == (160, 1) and table.choose(16, 16) == (16, 16)
    assert table.max_tokens == 256 and table.max_rows == 16
