"""One line saying what overflows a device and by how much (issue 25, item 8: "a layout that
cannot fit the device gets one line naming what overflows and by how much").

A run's summary has the fullest GPU's peak (``peak_memory_bytes``), the device's memory
(``device_memory_bytes``, the profile's ``compute.device_memory_GB`` in 10^9 bytes) and that
GPU's memory by category (``memory_breakdown_bytes``: ``sim.step.memory_breakdown``'s
categories, each at its most over the step, so their sum bounds the peak from above). When the
peak is above the device's memory, ``memory_verdict`` names the categories, the largest first
(activations with the micro-batches the fullest pipeline stage keeps in flight), and how much
the peak is over. Under the interleaved schedule and DualPipe what a stage keeps in flight are
model chunks, each one micro-batch through the chunk's layers (Megatron-Core's interleaved 1F1B:
(p - s - 1) x 2 + (v - 1) x p warm-up chunks and one more on stage s; DualPipe p + 1 chunks of L / p
layers on its middle stages: ``sim.pipeline``), so the line names them as such (issue 25: a count
of chunks read as whole-stage micro-batches looks p v / (layers a chunk) times too large).
"""

from __future__ import annotations

from testbed.core.units import format_bytes


def memory_verdict(breakdown: dict[str, float], peak_bytes: float, device_bytes: float, device: str = "device",
                   stage: int | None = None, in_flight: int | None = None,
                   chunk_layers: int | None = None) -> str | None:
    """The line for a GPU whose peak is ``peak_bytes`` on a ``device`` of ``device_bytes`` bytes,
    its memory by category ``breakdown`` (bytes); ``stage``: the pipeline stage it is on and
    ``in_flight``: the micro-batches that stage keeps in flight, or None without a pipeline;
    ``chunk_layers``: where they are model chunks (module doc), the most layers of one (None:
    whole-stage micro-batches, 1F1B). None when the peak fits."""
    if peak_bytes <= device_bytes:
        return None
    where = "the fullest GPU" + (f" (pipeline stage {stage})" if stage is not None else "")
    parts = []
    for name, size in sorted(breakdown.items(), key=lambda kv: -kv[1]):
        if size > 0:
            flight = ""
            if name == "activations" and in_flight:
                flight = (f" (micro-batches in flight: {in_flight})" if chunk_layers is None else
                          f" (model chunks in flight: {in_flight}, one micro-batch through up to {chunk_layers} "
                          f"layer{'s' if chunk_layers != 1 else ''} each)")
            parts.append(f"{name} {format_bytes(size)}{flight}")
    listed = (": " + ", ".join(parts) + " (each category at its most)") if parts else ""
    return (f"does not fit: {where} needs {format_bytes(peak_bytes)} of the {device}'s {device_bytes / 1e9:.4g} GB "
            f"({format_bytes(device_bytes)}){listed}; {format_bytes(peak_bytes - device_bytes)} over")


def summary_memory_verdict(summary: dict) -> str | None:
    """``memory_verdict`` of a run's ``summary`` (module doc), None where it fits or the backend
    gives no device memory (``fits_in_device_memory`` absent)."""
    if summary.get("fits_in_device_memory") is not False or not summary.get("device_memory_bytes"):
        return None
    pipe = summary.get("pipeline") or {}
    stage = pipe.get("fullest_stage")
    in_flight = pipe["in_flight"][stage] if stage is not None and pipe.get("in_flight") else None
    chunk_layers = None
    if in_flight and pipe.get("schedule") in ("interleaved", "dualpipe") and pipe.get("stage_chunk_layers"):
        chunk_layers = max(pipe["stage_chunk_layers"][stage])
    return memory_verdict(summary.get("memory_breakdown_bytes") or {}, summary["peak_memory_bytes"],
                          summary["device_memory_bytes"], summary.get("profile") or "device", stage, in_flight,
                          chunk_layers)
