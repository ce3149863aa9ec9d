"""Published throughput figures and step times, converted both ways in Megatron-LM's unit
(issue 26, item 3), so that a simulated step can be set beside a paper's TFLOP/s or MFU.

Megatron-LM logs "throughput per GPU (TFLOP/s/GPU)" as
``num_floating_point_operations(args, batch_size) / (elapsed_time_per_iteration * 10**12 *
args.world_size)`` (``training_log`` in ``megatron/training/training.py``, commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553, line 3550), ``batch_size`` the global batch in
sequences; the FLOPs are ``testbed.model.megatron_flops``' (forward and backward, no
recompute, causal attention's half of the scores). So, with F the step's Megatron FLOPs,
G GPUs and t the step time in seconds:

    TFLOP/s per GPU = F / (t x 1e12 x G),   t = F / (TFLOP/s per GPU x 1e12 x G).

An MFU is that TFLOP/s over the peak the paper divides by (its denominator, stated by the
caller: 989.5 TFLOP/s for the H100's dense bf16 in the MoE Parallel Folding paper, arXiv
2504.14960). A machine profile's ``compute.peak_tflops`` is the *measured* matmul ceiling
(771.18 on the h100, h800 and h200 profiles), not such a spec peak, and is never used here.

Units: seconds (``*_s``), TFLOP/s = 1e12 FLOP/s per GPU, MFU a fraction (0.463, not 46.3),
FLOPs per step or per token as counted (floats).
"""

from __future__ import annotations

from testbed.model.megatron_flops import megatron_flops
from testbed.model.transformer_shape import TransformerShape

TERA = 1e12  # FLOP/s in a TFLOP/s


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} = {value}: must be > 0")


def tflops_per_gpu_from_flops(flops_per_step: float, step_time_s: float, gpus: int) -> float:
    """TFLOP/s per GPU of a step of ``flops_per_step`` FLOPs taking ``step_time_s`` seconds
    on ``gpus`` GPUs, in Megatron-LM's expression (module doc)."""
    _positive(step_time_s=step_time_s, gpus=gpus)
    return flops_per_step / (step_time_s * TERA * gpus)


def tflops_per_gpu(step_time_s: float, global_batch: float, seq_len: int, gpus: int, shape: TransformerShape,
                   padded_vocab: int | None = None) -> float:
    """TFLOP/s per GPU that Megatron-LM logs for a step of ``global_batch`` sequences of
    ``seq_len`` tokens on ``gpus`` GPUs taking ``step_time_s`` seconds, the FLOPs
    ``megatron_flops(shape, global_batch, seq_len, padded_vocab)``."""
    _positive(global_batch=global_batch, seq_len=seq_len)
    return tflops_per_gpu_from_flops(megatron_flops(shape, global_batch, seq_len, padded_vocab), step_time_s, gpus)


def step_time_from_tflops(tflops_per_gpu: float, global_batch: float, seq_len: int, gpus: int,
                          shape: TransformerShape, padded_vocab: int | None = None) -> float:
    """Seconds of a step that a published ``tflops_per_gpu`` (TFLOP/s per GPU, Megatron's
    count) implies: ``megatron_flops(shape, global_batch, seq_len) / (tflops_per_gpu x 1e12
    x gpus)``, for ``global_batch`` sequences of ``seq_len`` tokens on ``gpus`` GPUs."""
    _positive(tflops_per_gpu=tflops_per_gpu, global_batch=global_batch, seq_len=seq_len, gpus=gpus)
    return megatron_flops(shape, global_batch, seq_len, padded_vocab) / (tflops_per_gpu * TERA * gpus)


def tflops_from_mfu(mfu: float, peak_tflops: float) -> float:
    """TFLOP/s per GPU of a published ``mfu`` (a fraction) against the paper's own
    denominator ``peak_tflops`` (TFLOP/s per GPU, e.g. 989.5 for the H100's dense bf16)."""
    _positive(mfu=mfu, peak_tflops=peak_tflops)
    return mfu * peak_tflops


def mfu_from_tflops(tflops_per_gpu: float, peak_tflops: float) -> float:
    """MFU (a fraction) of ``tflops_per_gpu`` against the stated ``peak_tflops`` (TFLOP/s
    per GPU: the denominator the figure it is compared with uses)."""
    _positive(peak_tflops=peak_tflops)
    return tflops_per_gpu / peak_tflops


def step_time_from_mfu(mfu: float, peak_tflops: float, global_batch: float, seq_len: int, gpus: int,
                       shape: TransformerShape, padded_vocab: int | None = None) -> float:
    """Seconds of a step that a published ``mfu`` (a fraction of ``peak_tflops``, the
    paper's denominator in TFLOP/s per GPU) implies, as ``step_time_from_tflops`` of
    ``mfu x peak_tflops``."""
    return step_time_from_tflops(tflops_from_mfu(mfu, peak_tflops), global_batch, seq_len, gpus, shape,
                                 padded_vocab)


def tokens_per_s_per_gpu(step_time_s: float, global_batch: float, seq_len: int, gpus: int) -> float:
    """Tokens per second per GPU of a step of ``global_batch`` sequences of ``seq_len``
    tokens taking ``step_time_s`` seconds on ``gpus`` GPUs."""
    _positive(step_time_s=step_time_s, global_batch=global_batch, seq_len=seq_len, gpus=gpus)
    return global_batch * seq_len / (step_time_s * gpus)


def step_time_from_tokens_per_s(tokens_per_s_per_gpu: float, global_batch: float, seq_len: int,
                                gpus: int) -> float:
    """Seconds of a step of ``global_batch`` sequences of ``seq_len`` tokens on ``gpus``
    GPUs at a published ``tokens_per_s_per_gpu``."""
    _positive(tokens_per_s_per_gpu=tokens_per_s_per_gpu, global_batch=global_batch, seq_len=seq_len, gpus=gpus)
    return global_batch * seq_len / (tokens_per_s_per_gpu * gpus)


def implied_flops_per_token(tflops_per_gpu: float, tokens_per_s_per_gpu: float) -> float:
    """FLOPs per token behind a pair of published figures (TFLOP/s per GPU and tokens/s per
    GPU of the same run): the publisher's own count, to set beside ``megatron_flops``'."""
    _positive(tflops_per_gpu=tflops_per_gpu, tokens_per_s_per_gpu=tokens_per_s_per_gpu)
    return tflops_per_gpu * TERA / tokens_per_s_per_gpu
