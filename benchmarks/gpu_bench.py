"""Efficiency of the real backend's GPU paths, against goals (issue 4, item 9).

Prints one line per measurement with its goal and PASS / MISS:

1. expert FFN TFLOP/s: the grouped GEMM path of ``real.kernels.experts`` (``torch._grouped_mm``,
   what ``PagedExpertFFN`` runs on CUDA bf16) against ``torch.bmm`` at the same shapes,
   the MoE shapes of ``benchmarks/h200-ceilings.json`` (E experts x T tokens each, hidden H, ffn F;
   4 E T H F FLOPs, gelu included in both). Goal: >= 85 % of bmm. The per-expert loop
   (the fallback) is shown for reference.
2. page copy GB/s, host (pinned) -> device, through ``PagedExpertStore.execute`` (the
   pager's moves as side-stream copies), per page size, against the pinned-copy ceiling
   of ``benchmarks/h200-ceilings.json``. Goal: >= 90 %.
3. the fraction of page copies hidden behind expert compute: copies alone, the expert
   FFN alone, both at once (copies on the store's side stream); hidden = (copy + compute
   - both) / copy. Goal: >= 85 %.
4. the page-pipelined expert FFN (M14: computed page by page as its pages arrive, on the
   per-expert loop and on the grouped GEMM) against load-then-compute, per tokens per expert and page size. Goal: >= 1.3x
   at the best page size with >= 2,048 tokens per expert.
5. router (``testbed.policy.router.route``) + permutation (source order, expert layout and the
   weighted combine) as a share of the expert FFN forward at a realistic shape. Goal: <= 10 %.

Without CUDA the same code runs with small shapes on the CPU, every line labelled
"CPU, not a goal check". Needs only torch, numpy and this project.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from real.kernels.experts import (  # noqa: E402
    GroupLayout,
    combine_slots,
    expert_ffn,
    grouped_forward,
    grouped_forward_weights,
    grouped_supported,
    source_slots,
)
from real.kernels.page_pipeline import blocked_ffn  # noqa: E402
from real.paging.paged_store import PagedExpertStore  # noqa: E402
from testbed.policy.capacity import expert_capacity  # noqa: E402
from testbed.policy.heat import COLD  # noqa: E402
from testbed.policy.pager import RankPager  # noqa: E402
from testbed.policy.router import route  # noqa: E402
from testbed.scenario.sections import PagerConfig, RouterConfig  # noqa: E402

CEILINGS = ROOT / "benchmarks" / "h200-ceilings.json"  # measured on an H200; its "source" says how
GPU_SHAPES = [(8, 4096, 4096, 14336), (64, 512, 4096, 1408), (128, 1024, 2048, 1408)]
CPU_SHAPES = [(8, 64, 64, 128), (16, 32, 64, 96)]
MB = 2 ** 20


def stamp() -> str:
    return time.strftime("%H:%M:%S")


def say(text: str) -> None:
    print(f"[{stamp()}] {text}", flush=True)


def ceilings() -> dict:
    return json.loads(CEILINGS.read_text())


class Bench:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.dev = torch.device("cuda" if cuda else "cpu")
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.label = "" if cuda else "  (CPU, not a goal check)"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, fn, min_s: float = 0.2, max_iters: int = 50) -> float:
        """Median seconds of ``fn()`` (warmed up, device synchronised around each call batch)."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        once = max(time.perf_counter() - t0, 1e-6)
        iters = int(min(max_iters, max(3, min_s / once)))
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            self.sync()
            samples.append(time.perf_counter() - t0)
        return float(np.median(samples))

    def rand(self, *shape, scale: float = 1.0, dtype=None) -> torch.Tensor:
        """Seeded normal values made on the device (the GPU shapes are GBs)."""
        g = torch.Generator(device=self.dev).manual_seed(hash(shape) % 2 ** 31)
        return (torch.randn(*shape, generator=g, device=self.dev, dtype=torch.float32) * scale).to(dtype or self.dtype)

    def verdict(self, ok: bool) -> str:
        return ("PASS" if ok else "MISS") if self.cuda else "CPU, no verdict"


# ---- 1. grouped GEMM vs bmm ---------------------------------------------------------------------
def gemm(b: Bench, shapes) -> None:
    say(f"expert FFN TFLOP/s, grouped vs bmm (goal >= 85 % of bmm){b.label}")
    print(f"  {'shape':28s} {'bmm':>8s} {'grouped':>8s} {'loop':>8s} {'% of bmm':>9s}")
    for shape in shapes:
        gemm_shape(b, *shape)  # one shape's tensors are freed before the next is made


def gemm_shape(b: Bench, e: int, t: int, h: int, f: int) -> None:
    x = b.rand(e * t, h, scale=0.25)
    w = b.rand(e, 2 * h * f, scale=1 / 64)
    w1 = w[:, : h * f].view(e, h, f)
    w2 = w[:, h * f:].view(e, f, h)
    x3 = x.view(e, t, h)
    layout = GroupLayout([t] * e, b.dev)
    flops = 4.0 * e * t * h * f
    with torch.no_grad():
        t_bmm = b.seconds(lambda: torch.bmm(torch.nn.functional.gelu(torch.bmm(x3, w1)), w2))
        t_grp = b.seconds(lambda: grouped_forward(x, w, layout, h, f))
        t_loop = b.seconds(lambda: expert_ffn(x, [t] * e, list(w), h, f, grouped=False), max_iters=10)
    ratio = t_bmm / t_grp
    name = f"E{e}_T{t}_H{h}_F{f}"
    print(f"  {name:28s} {flops / t_bmm / 1e12:8.1f} {flops / t_grp / 1e12:8.1f} {flops / t_loop / 1e12:8.1f} "
          f"{100 * ratio:8.1f}%  {b.verdict(ratio >= 0.85)}", flush=True)


# ---- 2. page copies through the paged store ----------------------------------------------------
def page_store(b: Bench, page_bytes: int, expert_bytes: int, experts: int) -> tuple[RankPager, PagedExpertStore]:
    elem = torch.empty((), dtype=b.dtype).element_size()
    cfg = PagerConfig(page_size_bytes=page_bytes, gpu_budget_bytes=experts * expert_bytes,
                      emergency_free_fraction=0.0, cold_consecutive_updates=1, prefetch_pages=0)
    ids = list(range(experts))
    pager = RankPager(0, ids, expert_bytes, cfg)
    store = PagedExpertStore(pager, expert_bytes // elem, b.dtype, b.dev,
                             lambda i: torch.full((expert_bytes // elem,), float(i)))
    return pager, store


def to_host(pager: RankPager, store: PagedExpertStore, step: int) -> None:
    """Cold-migrate every expert (clean pages: dropped, no bytes) so the next access loads all."""
    n = len(pager.experts)
    store.execute(pager.heat_update(np.ones(n, bool), np.full(n, COLD), np.zeros(n, bool), step))
    store.settle()


def copies(b: Bench, sizes_mb, total_bytes: int, ceil: dict) -> None:
    goal = "(goal >= 90 % of the pinned-copy ceiling)" if b.cuda else ""
    say(f"page copy GB/s, host -> device through PagedExpertStore {goal}{b.label}")
    print(f"  {'page':>7s} {'GB/s':>8s} {'ceiling':>8s} {'%':>7s}")
    for mb in sizes_mb:
        page = int(mb * MB)
        expert_bytes = max(page, total_bytes // 4)
        pager, store = page_store(b, page, expert_bytes, total_bytes // expert_bytes)
        rounds = []
        for step in range(4):
            to_host(pager, store, 2 * step)
            moves = pager.access(list(pager.experts), 2 * step + 1)
            pager.end_step()
            b.sync()
            t0 = time.perf_counter()
            nbytes = store.execute(moves)
            store.settle()
            rounds.append(nbytes / (time.perf_counter() - t0))
        gbps = float(np.median(rounds[1:])) / 1e9
        c = ceil.get(f"h2d_page{int(mb)}MB_GBps")
        name = f"{mb:g}MB" if mb >= 1 else f"{mb * 1024:g}KB"
        if c:
            print(f"  {name:>7s} {gbps:8.1f} {c:8.1f} {100 * gbps / c:6.1f}%  {b.verdict(gbps >= 0.9 * c)}", flush=True)
        else:
            print(f"  {name:>7s} {gbps:8.1f} {'-':>8s} {'-':>7s}  no ceiling at this page size", flush=True)
        del store, pager


# ---- 3. copies hidden behind expert compute ------------------------------------------------------
def overlap(b: Bench, shape, copy_bytes: int, page: int) -> None:
    say(f"page copies hidden behind expert compute (goal >= 85 %){b.label}")
    if not b.cuda:
        print("  n/a on the CPU: copies and compute share the cores (no copy engine, no streams): CPU, no verdict")
        return
    e, t, h, f = shape
    x = b.rand(e * t, h, scale=0.25)
    w = b.rand(e, 2 * h * f, scale=1 / 64)
    layout = GroupLayout([t] * e, b.dev)
    pager, store = page_store(b, page, copy_bytes // 4, 4)

    def copy_round(step):
        to_host(pager, store, 2 * step)
        moves = pager.access(list(pager.experts), 2 * step + 1)
        pager.end_step()
        return moves

    def timed(fn_copy, fn_compute, step):
        moves = copy_round(step) if fn_copy else None
        b.sync()
        t0 = time.perf_counter()
        if moves is not None:
            store.execute(moves)  # issued on the side stream, not waited for
        if fn_compute:
            with torch.no_grad():
                grouped_forward(x, w, layout, h, f)
        store.settle()
        b.sync()
        return time.perf_counter() - t0

    runs = {"copy": [], "compute": [], "both": []}
    for step in range(6):
        runs["copy"].append(timed(True, False, 3 * step))
        runs["compute"].append(timed(False, True, 3 * step + 1))
        runs["both"].append(timed(True, True, 3 * step + 2))
    c, m, both = (float(np.median(runs[k][1:])) for k in ("copy", "compute", "both"))
    hidden = (c + m - both) / c
    print(f"  copy {c * 1e3:.2f} ms, compute {m * 1e3:.2f} ms, both {both * 1e3:.2f} ms: "
          f"hidden {100 * hidden:.1f}%  {b.verdict(hidden >= 0.85)}", flush=True)


# ---- 4. page-pipelined expert FFN vs load-then-compute (M14) ---------------------------------------
def page_pipeline(b: Bench, experts: int, h: int, f: int, tokens_list, pages_mb) -> None:
    """Every expert's pages start on the host; load-then-compute issues all copies and
    computes once the pages are in; pipelined computes as the pages arrive. Two kernels:
    ``loop``, each expert page by page (``real.kernels.page_pipeline.blocked_ffn`` on
    ``PagedExpertStore.segments``), and ``grouped`` (CUDA bf16), one grouped GEMM over
    every expert contracted block by block (``grouped_blocked`` on the store's in-place
    ``stacked`` weights). Goal: the pipelined FFN >= 1.3x faster at its best page size
    when there are >= 2,048 tokens per expert."""
    say(f"page-pipelined expert FFN vs load-then-compute, {experts} experts H={h} F={f} "
        f"(goal >= 1.3x at the best page size with >= 2048 tokens per expert){b.label}")
    expert_bytes = 2 * h * f * torch.empty((), dtype=b.dtype).element_size()
    # on the CPU the grouped kernel is torch's fallback: run it there too, for its plumbing
    grouped_here = grouped_supported(b.dev, b.dtype, h, f) or (not b.cuda and hasattr(torch, "_grouped_mm"))
    kernels = ["loop"] + (["grouped"] if grouped_here else [])
    print(f"  {'kernel':>7s} {'tokens/expert':>13s} {'page':>7s} {'load, then ms':>14s} {'pipelined ms':>13s} "
          f"{'speedup':>8s}")
    for kernel in kernels:
        for tokens in tokens_list:
            x = b.rand(tokens * experts, h, scale=0.25)
            best = 0.0
            for mb in pages_mb:
                page = int(mb * MB)
                pager, store = page_store(b, page, expert_bytes, experts)
                store.page_events = True
                ids = [int(i) for i in pager.experts]
                counts = [tokens] * experts
                layout = GroupLayout(counts, b.dev)

                def compute(pipelined: bool, store=store, ids=ids, counts=counts, layout=layout, tokens=tokens):
                    if kernel == "grouped":
                        sw = store.stacked(ids, counts, pipelined)
                        return grouped_forward_weights(x, sw, layout, h, f, store.page_elems)
                    for k, i in enumerate(ids):
                        rows = x[k * tokens:(k + 1) * tokens]
                        if pipelined:
                            blocked_ffn(rows, store.segments(i), h, f)
                        else:
                            expert_ffn(rows, [tokens], [store.read(i)], h, f, grouped=False)

                def run(pipelined: bool, step: int, pager=pager, store=store, ids=ids) -> float:
                    to_host(pager, store, 2 * step)
                    moves = pager.access(ids, 2 * step + 1)
                    pager.end_step()
                    b.sync()
                    t0 = time.perf_counter()
                    store.execute(moves)
                    with torch.no_grad():
                        compute(pipelined)
                    store.settle()
                    b.sync()
                    return time.perf_counter() - t0

                plain = float(np.median([run(False, 4 * k) for k in range(3)]))
                piped = float(np.median([run(True, 4 * k + 2) for k in range(3)]))
                speedup = plain / piped
                best = max(best, speedup)
                name = f"{mb:g}MB" if mb >= 1 else f"{mb * 1024:g}KB"
                note = ("CPU, no verdict" if not b.cuda else "verdict on the best" if tokens >= 2048
                        else "no goal below 2048")
                print(f"  {kernel:>7s} {tokens:>13d} {name:>7s} {plain * 1e3:14.2f} {piped * 1e3:13.2f} "
                      f"{speedup:7.2f}x  {note}", flush=True)
                del store, pager
            if tokens >= 2048 or not b.cuda:
                print(f"  {kernel:>7s} {tokens:>13d} best {best:.2f}x  {b.verdict(best >= 1.3)}", flush=True)


# ---- 5. router + permutation vs expert compute -----------------------------------------------------
def router_share(b: Bench, tokens: int, h: int, experts: int, top_k: int, f: int) -> None:
    say(f"router + permutation as a share of expert compute (goal <= 10 %){b.label}")
    x = b.rand(tokens, h)
    wr = b.rand(experts, h, scale=0.02, dtype=torch.float32)
    br = torch.zeros(experts, device=b.dev)
    w = b.rand(experts, 2 * h * f, scale=1 / 64)
    cfg = RouterConfig()  # the defaults: Gumbel noise, capacity factor 1.25, drop by probability
    cap = expert_capacity(tokens, top_k, experts, cfg.capacity_factor, 1, False)
    noise = torch.Generator(device=b.dev).manual_seed(1)  # drawn on the device, as the real backend does

    def router(config=cfg):
        return route(x, wr, br, config, top_k, cap, 0, noise)

    def permute_and_combine(r):
        slots = source_slots(r.experts_TK, r.keep_TK)
        rows = x.index_select(0, slots // top_k)
        return combine_slots(rows, slots, r.probs_TK, tokens)

    with torch.no_grad():
        r = router()
        counts = r.kept_E.tolist()  # rows per expert after capacity, in source order
        slots = source_slots(r.experts_TK, r.keep_TK)
        rows = x.index_select(0, slots // top_k)
        layout = GroupLayout(counts, b.dev)
        if b.cuda:
            compute = b.seconds(lambda: grouped_forward(rows, w, layout, h, f))
        else:
            compute = b.seconds(lambda: expert_ffn(rows, counts, list(w), h, f, grouped=False))
        t_router = b.seconds(router)
        t_quiet = b.seconds(lambda: router(RouterConfig(noise="none")))
        t_perm = b.seconds(lambda: permute_and_combine(r))
    share = (t_router + t_perm) / compute
    print(f"  T={tokens} H={h} E={experts} top-{top_k} F={f}: router {t_router * 1e3:.2f} ms "
          f"({t_quiet * 1e3:.2f} ms without the Gumbel noise), "
          f"permutation {t_perm * 1e3:.2f} ms, experts {compute * 1e3:.2f} ms: "
          f"{100 * share:.1f}%  {b.verdict(share <= 0.10)}", flush=True)


def main() -> int:
    cuda = torch.cuda.is_available()
    b = Bench(cuda)
    ceil = ceilings()
    say(f"torch {torch.__version__}, " + (f"CUDA on {torch.cuda.get_device_name()}" if cuda else
                                          "CUDA is absent: small shapes on the CPU, not a goal check"))
    if cuda and not hasattr(torch, "_grouped_mm"):
        print("  this torch has no torch._grouped_mm: the expert FFN falls back to the loop")
    if cuda:
        gemm(b, GPU_SHAPES)
        copies(b, [1, 2, 4, 8, 16, 32, 64], 1024 * MB, ceil)
        overlap(b, GPU_SHAPES[0], 256 * MB, 16 * MB)
        page_pipeline(b, 8, 4096, 1408, [512, 2048, 8192], [1, 4, 16])
        router_share(b, 8192, 4096, 64, 8, 1408)
    else:
        gemm(b, CPU_SHAPES)
        copies(b, [1 / 16, 1 / 4, 1], 8 * MB, ceil)
        overlap(b, CPU_SHAPES[0], 8 * MB, MB)
        page_pipeline(b, 4, 64, 128, [256], [1 / 64, 1 / 16])
        router_share(b, 1024, 64, 16, 2, 128)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
