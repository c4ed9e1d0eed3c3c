"""The device prefetcher's hand-over (`DevicePrefetcher._hand_over`), with a fake stream.

On CUDA every handed-over tensor must be safe on the training stream: the stream waits
for the copies, and the allocations it reads are `record_stream`ed to it. The batches of
one window share one event and one slab, so the wait and the record happen once per
window (per training stream); tensors a batch allocated itself (padded lists) are
recorded with their batch, and the per-batch and device-gather paths' tensors each.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardcache.torch import _prefetch


class _Stream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


class _Tensor:
    def __init__(self) -> None:
        self.recorded: list[_Stream] = []

    def record_stream(self, stream: _Stream) -> None:
        self.recorded.append(stream)


def _prefetcher(monkeypatch: pytest.MonkeyPatch, streams: list[_Stream]) -> Any:
    current = iter(streams)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: next(current))
    prefetcher = _prefetch.DevicePrefetcher.__new__(_prefetch.DevicePrefetcher)
    prefetcher.device = torch.device("cuda", 0)
    prefetcher.stats = _prefetch.Stats()
    prefetcher._state = None
    prefetcher._waited = None
    return prefetcher


def _flight(done: object, owners: list[Any] | None, **tensors: Any) -> _prefetch._InFlight:
    fresh = [t for name, t in tensors.items() if name.startswith("fresh")]
    return _prefetch._InFlight(tensors, done, {"at": done}, [], owners, fresh)


def test_a_windows_batches_wait_and_record_its_memory_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    training = _Stream(7)
    prefetcher = _prefetcher(monkeypatch, [training] * 5)
    slab, offsets = _Tensor(), _Tensor()
    first, second = object(), object()
    views = [_Tensor() for _ in range(5)]
    padded = _Tensor()
    for i, done in enumerate([first, first, first, second, second]):
        tensors = {"tokens": views[i]}
        if i == 1:
            tensors["fresh_padded"] = padded
        prefetcher._hand_over(_flight(done, [slab, offsets], **tensors))
    assert training.waited == [first, second]
    assert slab.recorded == offsets.recorded == [training, training]
    assert padded.recorded == [training]
    assert all(not view.recorded for view in views)  # views of the recorded slab
    assert prefetcher.stats.batches == 5 and prefetcher.state_dict() == {"at": second}


def test_a_new_training_stream_waits_again_for_the_same_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = _Stream(1), _Stream(2)
    prefetcher = _prefetcher(monkeypatch, [a, b])
    slab, done = _Tensor(), object()
    prefetcher._hand_over(_flight(done, [slab], tokens=_Tensor()))
    prefetcher._hand_over(_flight(done, [slab], tokens=_Tensor()))
    assert a.waited == [done] and b.waited == [done]
    assert slab.recorded == [a, b]


def test_tensors_of_their_own_are_each_waited_for_and_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    training = _Stream(3)
    prefetcher = _prefetcher(monkeypatch, [training] * 2)
    done = object()
    batches = [{"tokens": _Tensor(), "tokens_offsets": _Tensor()} for _ in range(2)]
    for tensors in batches:
        prefetcher._hand_over(_flight(done, None, **tensors))
    assert training.waited == [done, done]
    assert all(t.recorded == [training] for tensors in batches for t in tensors.values())
