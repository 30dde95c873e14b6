"""The collective stream of each `neuron` device: where its collectives' time goes on the emulated clock.

A collective of the device (the "neuron" process group's, ``torch.neuron.comm``'s) occupies this stream for the
interconnect model's time, after the stream it was called from (its inputs were made there); who waits for it
makes their stream wait for its end, so the compute queued meanwhile overlaps with it, as a GPU's does with the
communication stream of NCCL.
"""
from __future__ import annotations

import contextlib

import torch

from neuronc.pytorch import queues

_streams: dict = {}  # device index -> the torch.Stream its collectives run on (the collective engine's)


@contextlib.contextmanager
def collective_streams(devices: list):
    """Inside: each device's current stream is its collective stream, which first waits for the stream that
    was current (the collective's inputs were made there)."""
    previous = [torch.accelerator.current_stream(i) for i in devices]
    index = torch.accelerator.current_device_index()
    for i, current in zip(devices, previous):
        stream = _streams.get(i)
        if stream is None:
            stream = _streams[i] = torch.Stream(device=torch.device("neuron", i))
        stream.wait_stream(current)
        torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        for stream in previous:
            torch.accelerator.set_stream(stream)
        torch.accelerator.set_device_index(index)


def occupy(devices: list, duration_ns: float, what: str) -> None:
    """Queue ``duration_ns`` of the collective engine's time on each device (inside collective_streams)."""
    for i in devices:
        queues.enqueue(i, duration_ns, _nothing, (), what)


def _nothing() -> None:
    """A collective's launch: its bytes moved when it was called; the launch only holds its time."""
