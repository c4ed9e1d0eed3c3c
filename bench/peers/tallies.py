"""The work every loader's training loop does, and the checksum that proves correctness.

Each loader hands its samples to one of three `add_*` methods. All three touch every
token id once (a per-sample sum) and fold every sample into an order-independent
digest, so a loader that shuffles still matches the generator's digest, while a
lost, duplicated or corrupted sample changes it. The digest of a sample mixes its uid,
its length and its token sum through splitmix64; the epoch digest is the sum of the
sample digests modulo 2**64.

Only numpy is used (a pyarrow dependency in practice), so the shardcache and pyarrow
runners need no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

_U64 = np.uint64
_MASK = (1 << 64) - 1
#: Per-sample loaders are folded into the digest in vectorized flushes of this many
#: samples, so their per-sample cost stays one numpy sum plus three array stores.
_SAMPLE_BUFFER = 8192


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # uint64 array arithmetic wraps modulo 2**64 without a warning, which is the point.
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def sample_digests(
    uids: npt.NDArray[np.int64], lengths: npt.NDArray[Any], sums: npt.NDArray[np.int64]
) -> npt.NDArray[np.uint64]:
    """One 64-bit digest per sample, from its uid, length and token sum."""
    u = _splitmix64(np.asarray(uids, dtype=np.int64).view(np.uint64))
    s = np.asarray(sums, dtype=np.int64).view(np.uint64) * _U64(0xD6E8FEB86659FD93)
    n = np.asarray(lengths, dtype=np.int64).view(np.uint64) * _U64(0xA0761D6478BD642F)
    return _splitmix64(u ^ s ^ n)


def segment_sums(values: npt.NDArray[Any], offsets: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """Sum modulo 2**32 of `values[offsets[i]:offsets[i+1]]` for each i (empty ones too).

    Modulo 2**32 because an int32 accumulator runs about 7x faster than an int64 one
    here, and the sum is a checksum, not a quantity: every path wraps the same way.
    """
    lengths = np.diff(offsets)
    sums = np.zeros(len(lengths), dtype=np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    if end == start:
        return sums
    nonempty = lengths > 0
    # reduceat sums from each start to the next listed start, so listing only the
    # non-empty segments (empty ones have no tokens between them) gives exact sums.
    starts = (offsets[:-1] - start)[nonempty]
    wrapped = np.add.reduceat(values[start:end], starts, dtype=np.int32)
    sums[nonempty] = wrapped.view(np.uint32)
    return sums


@dataclasses.dataclass
class Tally:
    """What a loader delivered: sample and token counts, token-id sum and digest.

    `token_sum` adds the per-sample sums modulo 2**32 (see `segment_sums`).
    """

    samples: int = 0
    tokens: int = 0
    token_sum: int = 0
    digest: int = 0
    _buf_uid: npt.NDArray[np.int64] = dataclasses.field(
        default_factory=lambda: np.empty(_SAMPLE_BUFFER, dtype=np.int64), repr=False
    )
    _buf_len: npt.NDArray[np.int64] = dataclasses.field(
        default_factory=lambda: np.empty(_SAMPLE_BUFFER, dtype=np.int64), repr=False
    )
    _buf_sum: npt.NDArray[np.int64] = dataclasses.field(
        default_factory=lambda: np.empty(_SAMPLE_BUFFER, dtype=np.int64), repr=False
    )
    _buffered: int = dataclasses.field(default=0, repr=False)

    # -- the three shapes loaders deliver --------------------------------------------
    def add_arrays(
        self,
        uids: npt.NDArray[np.int64],
        values: npt.NDArray[Any],
        offsets: npt.NDArray[Any],
    ) -> None:
        """A batch as flat token ids plus `len(uids) + 1` offsets into them."""
        sums = segment_sums(values, offsets)
        lengths = np.diff(offsets)
        self._fold(uids, lengths, sums)

    def add_record_batch(self, batch: Any, *, uid: str = "uid", tokens: str = "tokens") -> None:
        """A pyarrow RecordBatch with an int64 uid column and a list<int32> tokens column."""
        col = batch.column(tokens)
        # `offsets` honours a sliced array's offset; `values` is the whole child array,
        # which `segment_sums` indexes through those offsets.
        self.add_arrays(
            batch.column(uid).to_numpy(),
            col.values.to_numpy(),
            col.offsets.to_numpy(),
        )

    def add_sample(self, uid: int, tokens: npt.NDArray[Any]) -> None:
        """One sample as a uid and a 1-D array of token ids."""
        i = self._buffered
        self._buf_uid[i] = uid
        self._buf_len[i] = len(tokens)
        self._buf_sum[i] = int(tokens.sum(dtype=np.int32)) & 0xFFFFFFFF
        self._buffered = i + 1
        if self._buffered == _SAMPLE_BUFFER:
            self.flush()

    def flush(self) -> None:
        """Fold buffered samples in; call before reading the counts."""
        n = self._buffered
        if n:
            self._buffered = 0
            self._fold(self._buf_uid[:n], self._buf_len[:n], self._buf_sum[:n])

    # -- comparing ------------------------------------------------------------------
    def summary(self) -> dict[str, int]:
        self.flush()
        return {
            "samples": self.samples,
            "tokens": self.tokens,
            "token_sum": self.token_sum,
            "digest": self.digest,
        }

    def merged(self, other: Tally) -> Tally:
        """The tally of both deliveries together (a run resumed from saved state)."""
        self.flush()
        other.flush()
        return Tally(
            samples=self.samples + other.samples,
            tokens=self.tokens + other.tokens,
            token_sum=self.token_sum + other.token_sum,
            digest=(self.digest + other.digest) & _MASK,
        )

    def _fold(
        self, uids: npt.NDArray[Any], lengths: npt.NDArray[Any], sums: npt.NDArray[np.int64]
    ) -> None:
        self.samples += len(uids)
        self.tokens += int(lengths.sum())
        self.token_sum += int(sums.sum())
        self.digest = (self.digest + int(sample_digests(uids, lengths, sums).sum())) & _MASK


def mismatch(expected: dict[str, int], got: dict[str, int]) -> str | None:
    """A sentence naming what differs, or None when the delivery was exact."""
    diffs = [
        f"{k}: expected {expected[k]}, got {got.get(k)}"
        for k in expected
        if expected[k] != got.get(k)
    ]
    return "; ".join(diffs) if diffs else None
