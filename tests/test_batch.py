"""pack_step's flat layout, by hand: rows in order, then padding on the null page."""

import numpy as np
import pytest

from jaxserve.device.batch import pack_step
from jaxserve.host.plan import Chunk

PAGE_SIZE = 4


def test_a_decode_and_a_prefill_chunk_then_padding():
    decode = Chunk((7,), 5, (3, 9), row=0, is_prompt=False, request_id="a")
    chunk = Chunk((1, 2, 3), 2, (4,), row=1, request_id="b")  # positions 2..4 need 2 pages
    with pytest.raises(ValueError, match="row 0: 1 pages do not cover positions up to 5"):
        pack_step([chunk], PAGE_SIZE, 8, 3, 4, spare_row=9)
    chunk = Chunk((1, 2, 3), 2, (4, 6), row=1, request_id="b")
    inputs = pack_step([decode, chunk], PAGE_SIZE, 8, 3, 4, spare_row=9)
    m = inputs.metadata
    np.testing.assert_array_equal(inputs.token_ids, [7, 1, 2, 3, 0, 0, 0, 0])
    np.testing.assert_array_equal(inputs.positions, [5, 2, 3, 4, 0, 0, 0, 0])
    np.testing.assert_array_equal(m.seq_ids, [0, 1, 1, 1, 3, 3, 3, 3])
    # page 9 slot 1; page 4 slots 2, 3; page 6 slot 0; padding: the null page's slot 0
    np.testing.assert_array_equal(m.slot_mapping, [37, 18, 19, 24, 0, 0, 0, 0])
    np.testing.assert_array_equal(m.page_table, [[3, 9, 0, 0], [4, 6, 0, 0], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(m.cu_q_lens, [0, 1, 4, 4, 4])
    np.testing.assert_array_equal(m.kv_lens, [6, 5, 0, 0])
    np.testing.assert_array_equal(m.logits_indices, [0, 3, 0])
    np.testing.assert_array_equal(inputs.sampling.prompt_rows, [9, 1, 1, 1, 9, 9, 9, 9])
    np.testing.assert_array_equal(inputs.sampling.rows, [0, 1, 9])
    with pytest.raises(ValueError, match="exceed the bucket"):
        pack_step([decode, chunk], PAGE_SIZE, 3, 3, 4, spare_row=9)
