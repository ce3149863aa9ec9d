"""``testbed plan MODEL --gpus N --profile P``: the layouts of a model on a cluster, ranked by
simulated tokens/s per GPU (issue 27; ``testbed.study.plan``). MODEL is a preset name
(``testbed model --list``) or a Hugging Face config.json. Prints the top 10 with their memory,
bubble, exposed time and dominant stage, and the published runs' places in the ranking; writes
the plotly page and the ranking as CSV and JSON.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from testbed.core.errors import ScenarioError

GB = 1e9
#: rows printed (testbed.study.plan.TOP)
TOP = 10


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="search a model's parallel layouts on a cluster, ranked by simulated tokens/s "
                       "per GPU", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL", help="a preset name (testbed model --list) or a config.json")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the cluster")
    p.add_argument("--profile", required=True, help="machine profile (h100, h800, h200, ...)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences a step (default: one a GPU)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length in tokens (default 4096)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of a node (default 8)")
    p.add_argument("--space", default="default", help="default: TP, PP, EP, ETP, folding, fp8 (docs/plan.md); "
                   "wide: also CP, virtual chunks, micro-batch 2, every dispatcher, recompute, paging")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=V1,V2",
                   help="the candidates of one knob (repeatable), e.g. parallelism.pp_chunks=1,2")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE", help="pin a knob (repeatable)")
    p.add_argument("--max-memory", type=float, default=None, metavar="GB",
                   help="the fullest GPU's memory at most this (10^9 bytes), below the device's")
    p.add_argument("--no-fp8", action="store_true", help="no fp8 GEMMs (--fix model.gemm_dtype=model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="change the base scenario (repeatable)")
    p.add_argument("--no-published", action="store_true", help="do not simulate the published runs of the setup")
    p.add_argument("--jobs", type=int, default=None, help="parallel simulator processes (default: every core)")
    p.add_argument("--executor", default="local", help="local (a process pool) or dask")
    p.add_argument("--address", default=None, help="with --executor dask: the scheduler's address")
    p.add_argument("--output-dir", default="runs", help="the run store (default runs); the plan's index is "
                   "in its sweeps/")
    p.add_argument("--report", default=None, metavar="FILE.html", help="default reports/<plan name>.html")
    p.add_argument("--fresh", action="store_true", help="run every layout again, ignoring the plan's index")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def _value(raw: str):
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()  # a bare word such as fp8


def _pairs(items: list[str], option: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key.count(".") != 1 or not raw.strip():
            raise ScenarioError(option, item, "expected section.key=value")
        out.append((key.strip(), raw))
    return out


def options(args):
    """The search's ``testbed.study.plan.PlanOptions`` from the command line."""
    from testbed.study.plan import PlanOptions

    fixed = {k: _value(v) for k, v in _pairs(args.fix, "--fix")}
    if args.no_fp8:
        if fixed.get("model.gemm_dtype", "model") != "model":
            raise ScenarioError("--no-fp8", "", f"contradicts --fix model.gemm_dtype={fixed['model.gemm_dtype']}")
        fixed["model.gemm_dtype"] = "model"
    knobs = {k: [_value(x) for x in v.split(",")] for k, v in _pairs(args.knob, "--knob")}
    if args.max_memory is not None and args.max_memory <= 0:
        raise ScenarioError("--max-memory", args.max_memory, "must be > 0 (GB, 10^9 bytes)")
    return PlanOptions(space=args.space, knobs=knobs, fixed=fixed,
                       max_memory_bytes=args.max_memory * GB if args.max_memory else None, jobs=args.jobs,
                       executor=args.executor, address=args.address, fresh=args.fresh,
                       progress=not args.no_progress, published=not args.no_published)


def run(args) -> int:
    from testbed.report.plan_report import write_plan_outputs
    from testbed.study.plan import plan_base, run_plan

    base = plan_base(args.model, args.gpus, args.profile, args.global_batch, args.seq, args.gpus_per_node,
                     args.output_dir, args.overrides)
    label = Path(args.model).stem if args.model.endswith(".json") else args.model
    result = run_plan(base, label, options(args))
    report = Path(args.report) if args.report else Path("reports") / f"{result['name']}.html"
    result["outputs"] = {k: str(v) for k, v in write_plan_outputs(result, report).items()}
    if args.json:
        slim = {k: v for k, v in result.items() if k not in ("ranking", "not_ranked")}
        print(json.dumps(slim, default=str))
    else:
        print(format_plan(result))
    return 0


def _gap(gap: float) -> str:
    """A published run's gap to the plan's best, in words."""
    return f"{100 * abs(gap):.1f}% {'slower' if gap > 0 else 'faster'} than the plan's best"


def _gb(x) -> str:
    return "—" if x is None else f"{x / GB:.1f}"


def _row(e: dict) -> str:
    return (f"{e['rank']:>4} {e['tokens_per_s_per_gpu']:>9,.0f} {100 * (e['mfu'] or 0):>5.1f}% "
            f"{e['step_time_s']:>7.3f} {_gb(e['peak_memory_bytes']):>6} {100 * (e['bubble_fraction'] or 0):>5.1f}% "
            f"{e['exposed_s'] or 0:>7.3f} {e['dominant_stage']!s:<17} {e['label']}")


def format_plan(r: dict) -> str:
    pruned = ", ".join(f"{k} {v}" for k, v in r["pruned"].items()) or "none"
    refused = ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items(), key=lambda kv: -kv[1])) or "none"
    lines = [(f"plan {r['name']}: {r['enumerated']} layouts considered, {r['valid']} valid (refused: {refused}; "
             f"{r['same_as_folded']} nested with the groups of a folded one); "
             f"pruned by the memory bound: {pruned}; {r['simulated']} simulated ({r['ran_now']} now), "
             f"{sum(r['not_fitting'].values())} over memory when simulated, {r['ranked']} ranked "
             f"[{r['wall_s']:.0f} s]"),
             (f"top {min(TOP, r['ranked'])} by tokens/s per GPU (peak memory in GB, exposed: the simulated step's "
             f"time outside compute, s):"),
             (f"{'rank':>4} {'tokens/s':>9} {'MFU':>6} {'step s':>7} {'mem GB':>6} {'bubble':>6} {'exposed':>7} "
             f"{'dominant stage':<17} layout")]
    lines += [_row(e) for e in r["top"]]
    for p in r.get("published", []):
        held = ", ".join(f"{k.rsplit('.', 1)[-1]} {v}" for k, v in p.get("held", {}).items())
        lines.append(f"published {p['config']}: rank {p['rank']} of {p['of']}" + (f" with its {held}" if held else "")
                     + f" (of all {p['rank_of_all']}), {p['tokens_per_s_per_gpu']:,.0f} "
                     f"tokens/s per GPU, {_gap(p['gap_to_best'])}; in the top 5 or within "
                     f"5%: {'yes' if p['placed'] else 'no'}"
                     + (f"; its layout in the plan: rank {p['plan_rank_of_layout']}" if p["layout_in_space"]
                        else "; its layout is outside the plan's space")
                     + (f"; why: {p['why']}" if p["why"] else ""))
    for o in r.get("published_order", []):
        lines.append(f"published order ({o['unit']}): {' < '.join(o['published_order'])}; plan's: "
                     f"{' < '.join(o['plan_order'])}: {'agrees' if o['agrees'] else 'differs'}")
    lines.append("wrote " + ", ".join(r.get("outputs", {}).values()))
    return "\n".join(lines)
