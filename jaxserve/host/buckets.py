"""The bucket table: the only shapes the step is ever compiled for.

A bucket is a (num_tokens, num_rows) pair. The scheduler pads every batch up to
the smallest bucket that holds it, so XLA never compiles while serving.
"""

import itertools
from dataclasses import dataclass


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2·low, 4·low … up to and including the first value ≥ high."""
    sizes, n = [], max(1, low)
    while True:
        sizes.append(n)
        if n >= high:
            return tuple(sizes)
        n *= 2


def token_sizes(low: int, budget: int) -> tuple[int, ...]:
    """Powers of two from `low` up to half the budget, then steps of max(32, budget / 8)
    up to the budget.

    A step's cost on a CPU grows with its padded tokens, and a power of two pads a prompt
    just past one by up to half of the next: a 150-token prompt paid for 256. The top
    octave, where most prefill chunks fall, gets finer steps instead (160, 192, 224 for
    256), which pad by at most 32 tokens, at three more sizes to compile."""
    sizes = [n for n in powers_of_two(low, budget) if 2 * n <= budget]
    step = max(32, budget // 8)
    return (*sizes, *range(sizes[-1] + step if sizes else low, budget, step), budget)


def draft_logits(bucket: tuple[int, int], num_speculative_tokens: int) -> int:
    """How many draft tokens a step of `bucket` verifies at most (a logit row each, after
    its rows' own): what its tokens hold beyond one a row, up to `num_speculative_tokens`
    a row. So a step of one token a row computes none, and no bucket is added."""
    tokens, rows = bucket
    return min(tokens - rows, rows * num_speculative_tokens)


@dataclass(frozen=True, slots=True)
class BucketTable:
    """Token-count and row-count sizes; every (tokens ≥ rows) pair is a bucket."""

    token_sizes: tuple[int, ...]
    row_sizes: tuple[int, ...]

    @staticmethod
    def for_limits(max_batch: int, token_budget: int, min_tokens: int = 1) -> "BucketTable":
        """Powers of two covering up to `max_batch` rows, and `token_sizes` up to
        `token_budget` tokens a step."""
        return BucketTable(token_sizes(min_tokens, token_budget), powers_of_two(1, max_batch))

    @staticmethod
    def parse(spec: str) -> "BucketTable":
        """`TOKENS:ROWS`, each a comma-separated list of sizes, e.g. `1,8,64:1,8,64`."""
        tokens, sep, rows = spec.partition(":")
        try:
            sizes = tuple(int(n) for n in tokens.split(",")), tuple(int(n) for n in rows.split(","))
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(
                f"buckets must be TOKEN_SIZES:ROW_SIZES, e.g. 1,8,64:1,8,64; got {spec!r}"
            )
        return BucketTable(*sizes)

    def __post_init__(self) -> None:
        for name in ("token_sizes", "row_sizes"):
            sizes = getattr(self, name)
            if not sizes or sizes[0] < 1 or any(a >= b for a, b in itertools.pairwise(sizes)):
                raise ValueError(f"{name} must be increasing positive sizes, got {sizes}")

    def covers(self, max_batch: int, token_budget: int) -> None:
        """Raise unless a full batch (`max_batch` rows, `token_budget` tokens) has a bucket."""
        if self.max_rows < max_batch or self.max_tokens < token_budget:
            raise ValueError(
                f"the largest bucket ({self.max_tokens} tokens, {self.max_rows} rows) must hold "
                f"a full step: token_budget {token_budget}, max_batch {max_batch}"
            )

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    @property
    def max_rows(self) -> int:
        return self.row_sizes[-1]

    def buckets(self) -> list[tuple[int, int]]:
        """Every (num_tokens, num_rows) shape to compile, smallest first."""
        return [(t, s) for s in self.row_sizes for t in self.token_sizes if t >= s]

    def choose(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """The smallest bucket holding `num_tokens` tokens in `num_rows` rows."""
        seqs = next((s for s in self.row_sizes if s >= num_rows), None)
        tokens = next((t for t in self.token_sizes if t >= max(num_tokens, seqs or 0)), None)
        if seqs is None or tokens is None:
            raise ValueError(
                f"no bucket holds {num_tokens} tokens in {num_rows} rows "
                f"(largest: {self.max_tokens} tokens, {self.max_rows} rows)"
            )
        return tokens, seqs
