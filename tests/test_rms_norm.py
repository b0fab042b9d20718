"""RMSNorm gives each row the same bits whatever rows share its batch.

XLA:CPU reduces a row in an order that depends on the number of rows (a residual add and
a norm's mean, jitted together, gave 1 or 4 rows other bits than 8 or 16 on an Intel
Xeon), which made a decode row's K/V depend on its step's bucket and seeded sampling flip
tokens; `row_sum` fixes the order."""

import jax
import numpy as np
import pytest

from jaxserve.models.layers import rms_norm, row_sum


@pytest.mark.parametrize("width", [576, 64, 100, 1])
def test_a_rows_norm_has_the_same_bits_in_any_batch(width):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, width)).astype(np.float32) * 3
    b = rng.standard_normal((64, width)).astype(np.float32)
    w = rng.standard_normal(width).astype(np.float32)
    norm = jax.jit(lambda a, b: rms_norm(a + b, w, 1e-5))  # fused as in a layer
    whole = np.asarray(norm(a, b))
    for m in (1, 2, 3, 4, 5, 8, 9, 16):
        for start in range(0, 64, 16):  # 64 rows of values, taken m at a time
            np.testing.assert_array_equal(np.asarray(norm(a[start:start + m], b[start:start + m])),
                                          whole[start:start + m], f"{m} rows from {start}")
    x = (a + b).astype(np.float64)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-6)


def test_row_sum_adds_every_entry_once():
    x = np.arange(3 * 7, dtype=np.float32).reshape(3, 7)  # small integers: exact
    np.testing.assert_array_equal(np.asarray(row_sum(x)), x.sum(-1, keepdims=True))
