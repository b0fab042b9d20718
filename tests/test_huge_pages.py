"""The KV pool and the weights on 2 MiB pages (jaxserve/device/huge_pages.py)."""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device.huge_pages import HUGE_PAGE, back_with_huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_buffer_is_collapsed_into_huge_pages_with_its_values_kept():
    values = np.arange(4 * HUGE_PAGE // 4, dtype=np.float32)
    array = jax.device_put(values, jax.devices("cpu")[0])
    jax.block_until_ready(array)
    collapsed = back_with_huge_pages([array])
    if collapsed == 0:
        pytest.skip("this kernel gives no 2 MiB pages (THP never, or Linux before 6.1)")
    # the 2 MiB-aligned spans inside the 8 MiB buffer: at least 3 of its 4
    assert 3 * HUGE_PAGE <= collapsed <= 4 * HUGE_PAGE
    assert huge_kib_at(array.unsafe_buffer_pointer() + HUGE_PAGE) >= collapsed // 1024
    np.testing.assert_array_equal(np.asarray(array), values)
    np.testing.assert_array_equal(np.asarray(array + 1), values + 1)  # still computes


def test_small_buffers_are_left_alone():
    assert back_with_huge_pages([jnp.zeros(1024, jnp.float32)]) == 0
