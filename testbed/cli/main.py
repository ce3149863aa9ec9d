"""The ``testbed`` command: run a scenario, write a report, list the scenario fields.

Every user error (bad scenario, missing file, unknown backend) is printed as one line
``testbed: error: FIELD = VALUE: reason`` and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
import time
from pathlib import Path

from testbed.cli.model import add_parser as _add_model
from testbed.cli.plan import add_parser as _add_plan
from testbed.core.errors import ScenarioError, run_as_command
from testbed.core.units import format_bytes
from testbed.run.backend import get_tool
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import field_docs


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_as_command("testbed", lambda: args.func(args),
                          "stopped; the steps finished so far are in the run folder")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="testbed", description="MoE infrastructure testbed: one scenario, a simulator and real PyTorch ranks.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a scenario and store it under run.output_dir")
    run.add_argument("config", nargs="?", help="scenario TOML file (default: the built-in quick-start scenario)")
    run.add_argument("--backend", default="sim", help="sim (default) or real")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one scenario field (repeatable)")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    run.add_argument("--no-progress", action="store_true", help="do not show progress on stderr")
    run.add_argument("--force", action="store_true", help="run even past the size and ranks-per-core limits")
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a stopped real run from its latest complete checkpoint (M23), in that "
                          "folder; without CONFIG its scenario.toml is used")
    run.set_defaults(func=_cmd_run)

    runs = sub.add_parser("runs", help="list the run store: id, scenario, backend, date, steps, complete")
    runs.add_argument("--output-dir", default="runs", help="the store (run.output_dir; default runs)")
    runs.set_defaults(func=_cmd_runs)

    rep = sub.add_parser("report", help="compare runs in one self-contained HTML page")
    rep.add_argument("run_dirs", nargs="*", metavar="RUN_DIR")
    rep.add_argument("--latest", metavar="CONFIG", default=None,
                     help="compare the newest complete run of this scenario on each backend (with --set)")
    rep.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="with --latest: override one scenario field (repeatable)")
    rep.add_argument("-o", "--output", required=True, metavar="FILE.html")
    rep.set_defaults(func=_cmd_report)

    chk = sub.add_parser("check", help="validate a scenario file and print it resolved")
    chk.add_argument("config")
    chk.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    chk.set_defaults(func=_cmd_check)

    cal = sub.add_parser("calibrate", help="measure this machine with the real backend and write profiles/NAME.toml")
    cal.add_argument("--name", required=True, help="profile name (use it as cluster.profile = NAME)")
    cal.add_argument("--fabric", default="loopback", choices=("loopback", "emulated"),
                     help="ranks over loopback (default) or on the emulated cluster (root)")
    cal.add_argument("--ranks", type=int, default=4, help="loopback: largest number of ranks to measure with (default 4)")
    cal.add_argument("--base", default=None,
                     help="profile whose link figures are kept (default local-cpu; emulated: emulated; cuda: h200)")
    cal.add_argument("--output-dir", default="profiles", help="where the profile goes (default ./profiles)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (about half the time)")
    cal.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                     help="cpu: CPU ranks over gloo (default); cuda: this machine's GPU and NCCL (base profile h200)")
    cal.set_defaults(func=_cmd_calibrate)

    fld = sub.add_parser("fields", help="list every scenario field with its default and meaning, by section")
    fld.add_argument("sections", nargs="*", metavar="SECTION", help="only these sections (model, cluster, ...)")
    fld.add_argument("--width", type=int, default=None, help="wrap at this many columns (default: the terminal's)")
    fld.set_defaults(func=_cmd_fields)

    reg = sub.add_parser("regress", help="run small simulator sweeps and compare their tuning decisions and key "
                         "metrics with the golden file (exit 1 when one moved)")
    reg.add_argument("--update", action="store_true", help="rewrite the golden file from this run and print the diff")
    reg.add_argument("--golden", default=None, metavar="PATH",
                     help="golden file (default: testbed/study/golden/regress.json in the package)")
    reg.add_argument("--output-dir", default=None, help="keep the runs in this run store (default: a temporary "
                     "folder, removed afterwards)")
    reg.add_argument("--jobs", type=int, default=None, help="parallel simulator processes (default: every core)")
    reg.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    reg.set_defaults(func=_cmd_regress)

    _add_collective(sub)
    _add_model(sub)
    _add_plan(sub)

    net = sub.add_parser("net", help="the emulated cluster network (real.network = emulated; needs root)")
    net_sub = net.add_subparsers(dest="net_command", required=True)
    ls = net_sub.add_parser("list", help="emulated clusters on this machine, their owner and whether it lives")
    ls.set_defaults(func=_cmd_net_list)
    clean = net_sub.add_parser("clean", help="remove the namespaces (and processes in them) of killed emulated runs")
    clean.add_argument("--force", action="store_true", help="also those of live runs")
    clean.set_defaults(func=_cmd_net_clean)
    probe = net_sub.add_parser("probe", help="measure an emulated cluster's links and which algorithms gloo runs")
    probe.add_argument("config", nargs="?", help="scenario whose cluster and profile to probe (default: 2 x 2 x 2 "
                       "on the emulated profile)")
    probe.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    probe.add_argument("--json", action="store_true", help="print the result as one JSON object")
    probe.add_argument("--write", metavar="PROFILE.toml", help="write a copy of the profile with the measured "
                       "latencies and protocol overhead")
    probe.set_defaults(func=_cmd_net_probe)
    return p


def _add_collective(sub) -> None:
    """``testbed collective KIND``: an nccl-tests table of one collective (testbed.cli.collective)."""
    p = sub.add_parser("collective", help="time one collective by size, simulated or on real ranks, as an "
                       "nccl-tests table (size, time, algbw, busbw)",
                       description="Time one collective by size and print it as nccl-tests does. Sizes are "
                       "nccl-tests' (all_gather: the output buffer; reduce_scatter: the input; all_to_all: each "
                       "rank's send buffer); busbw = algbw x 2(n-1)/n (all_reduce) or (n-1)/n.")
    p.add_argument("kind", metavar="KIND", help="all_reduce, all_gather, reduce_scatter or all_to_all "
                   "(or nccl-tests' allreduce, allgather, reducescatter, alltoall)")
    p.add_argument("--sizes", default="1M:1G", help="BEGIN:END or one size; K, M, G are powers of 2 as in "
                   "nccl-tests' -b and -e (default 1M:1G)")
    p.add_argument("-f", "--factor", default="2", help="factor between sizes (nccl-tests' -f; default 2)")
    p.add_argument("--gpus", required=True, help="GPUs (ranks) taking part")
    p.add_argument("--nodes", default="1", help="nodes they are on; must divide --gpus (default 1)")
    p.add_argument("--nodes-per-leaf", default=None, help="nodes under one leaf switch (default: all)")
    p.add_argument("--profile", default=None, help="machine profile (default h200; real: the emulated cluster's, "
                   "default emulated)")
    p.add_argument("--backend", default="sim", help="sim (default) or real (ranks on this machine: gloo, or NCCL "
                   "with a GPU per rank)")
    p.add_argument("--fabric", default="loopback", help="real: loopback (default) or emulated (an emulated "
                   "cluster of --gpus on --nodes; root)")
    p.add_argument("--iters", default="20", help="real: timed calls per size (default 20, as nccl-tests' -n)")
    p.add_argument("--warmup", default="5", help="real: warm-up calls per size (default 5, as nccl-tests' -w)")
    p.add_argument("--json", action="store_true", help="print the table as one JSON object")
    p.set_defaults(func=_cmd_collective)


def _cmd_collective(args) -> int:
    from testbed.cli.collective import run

    return run(args)


def _cmd_run(args) -> int:
    from testbed.run.runner import run_scenario

    config = args.config
    if args.resume and not (Path(args.resume) / "scenario.toml").is_file():
        raise ScenarioError("--resume", args.resume, "not a run folder (no scenario.toml in it)")
    if config is None and args.resume:
        config = str(Path(args.resume) / "scenario.toml")
    scenario = load_scenario(config, args.overrides)
    summary = run_scenario(scenario, args.backend, progress=not args.no_progress, resume=args.resume,
                           force=args.force)
    if not summary.get("run_dir"):
        return 0  # a torchrun rank other than 0: rank 0 prints the run
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
    return 0


def _cmd_runs(args) -> int:
    from testbed.run.store import list_runs

    rows = list_runs(args.output_dir)
    if not rows:
        print(f"no runs in {args.output_dir}")
        return 0
    width = max(len("run"), *(len(r["id"]) for r in rows))
    print(f"{'run':{width}s}  {'backend':7s}  {'started':19s}  {'state':22s}  scenario")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started"])) if r["started"] else "?"
        state = "complete" if r["complete"] else f"incomplete ({r['steps']} steps)"
        print(f"{r['id']:{width}s}  {r['backend']:7s}  {when:19s}  {state:22s}  {r['scenario']}")
    return 0


def _cmd_report(args) -> int:
    from testbed.report.comparison import write_comparison_report
    from testbed.run.store import latest_run

    run_dirs = list(args.run_dirs)
    if args.latest:
        scenario = load_scenario(args.latest, args.overrides)
        found = [d for backend in ("sim", "real") if (d := latest_run(scenario, backend)) is not None]
        if not found:
            raise ScenarioError("--latest", args.latest, f"no complete run of this scenario in {scenario.run.output_dir}")
        run_dirs += [str(d) for d in found]
    if not run_dirs:
        raise ScenarioError("RUN_DIR", "", "give run folders, or --latest CONFIG")
    # a glob such as runs/sim-* takes every sweep's runs too: say how many are compared
    print(f"testbed report: comparing {len(run_dirs)} run folder(s)"
          + (" (testbed runs lists them; --latest CONFIG takes one per backend)" if len(run_dirs) > 6 else ""),
          file=sys.stderr)
    path = write_comparison_report(run_dirs, args.output)
    print(f"wrote {path}")
    return 0


def _cmd_calibrate(args) -> int:
    calibrate = get_tool("calibrate")  # found by name, like a backend: testbed never imports real
    path = calibrate(args.name, ranks=args.ranks, base=args.base, out_dir=args.output_dir, quick=args.quick,
                     fabric=args.fabric, log=lambda line: print(line, file=sys.stderr), device=args.device)
    print(path)
    return 0


def _cmd_net_list(args) -> int:
    rows = get_tool("net-leftovers")()
    if not rows:
        print("no emulated clusters on this machine")
    for r in rows:
        owner = "alive" if r.get("owner_alive") else "gone"
        print(f"{r['run_id']}  owner {r.get('owner_pid')} ({owner})  {len(r['namespaces'])} namespaces")
    return 0


def _cmd_net_clean(args) -> int:
    removed = get_tool("net-clean")(force=args.force)
    print(f"removed {len(removed)} namespaces" + (": " + " ".join(removed) if removed else ""))
    return 0


def _cmd_net_probe(args) -> int:
    from testbed.cli.net_probe import format_probe, probe_scenario

    result = probe_scenario(args.config, args.overrides, write=args.write)
    print(json.dumps(result) if args.json else format_probe(result))
    return 0


def _cmd_regress(args) -> int:
    from testbed.study.regress import main as regress

    return regress(args.golden, update_golden=args.update, output_dir=args.output_dir,
                   progress=not args.no_progress, jobs=args.jobs)


def _cmd_check(args) -> int:
    import tomli_w

    from testbed.policy.pipeline_stages import check_pipeline

    scenario = load_scenario(args.config, args.overrides)
    check_pipeline(scenario)  # the pipeline's layout string, stages and schedule (the parser's one-line errors)
    print(tomli_w.dumps(scenario.to_dict()), end="")
    return 0


def _cmd_fields(args) -> int:
    from testbed.scenario.sections import SECTIONS

    width = max(40, args.width or shutil.get_terminal_size((100, 24)).columns)
    known = [*SECTIONS, "faults[]"]
    for name in args.sections:
        if name not in known:
            raise ScenarioError("SECTION", name, f"no such section ({', '.join(known)})")
    section = None
    for name, default, text in field_docs():
        head, key = name.split(".", 1)
        if args.sections and head not in args.sections:
            continue
        if head != section:
            cls = SECTIONS.get(head)
            doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()) if cls else "fault events"
            print(("" if section is None else "\n") + textwrap.fill(f"[{head}]  {doc}", width=width,
                                                                    subsequent_indent="    "))
            section = head
        print(f"  {key} = {default!r}")
        print(textwrap.fill(text, width=width, initial_indent="      ", subsequent_indent="      "))
    return 0


def format_summary(s: dict) -> str:
    """The summary as a few readable lines."""
    ms = lambda x: f"{x * 1e3:.3f} ms"  # noqa: E731
    stages = " | ".join(f"{k} {ms(v)}" for k, v in s["stage_time_s"].items() if v > 0)
    stage_bytes = " | ".join(f"{k} {format_bytes(v)}" for k, v in s["bytes_by_stage"].items() if v > 0)
    levels = " | ".join(f"{k} {format_bytes(v)}" for k, v in s["bytes_by_level"].items())
    hit = s.get("group_cache_hit_rate")
    lines = [
        f"run        {s['run_dir']}  ({s['backend']}, {s['steps']} steps, {s['measured_steps']} measured)",
        f"step time  {ms(s['step_time_s'])} (median)",
        *([f"throughput {s['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"
           + (f", MFU {100 * s['mfu']:.1f}% of the profile's peak (the {s.get('flops_of') or 'MoE stack'}'s FLOPs)"
              if s.get("mfu") else "")
           + (f", {s['megatron_tflops_per_gpu']:.4g} TFLOP/s per GPU in Megatron-LM's count"
              if s.get("megatron_tflops_per_gpu") else "")]
          if s.get("tokens_per_s_per_gpu") else []),
        f"sources    profile {s.get('profile', '?')} ({'calibrated on this machine' if s.get('profile_calibrated_here') else 'not calibrated on this machine'}), routing: {s.get('routing_source', '?')}",
        f"stages     {stages}",
        f"bytes      {stage_bytes or '0'}  (per step, all ranks)",
        f"levels     {levels}  (payload, each transfer once)",
        f"memory     peak {format_bytes(s['peak_memory_bytes'])} on the fullest rank"
        + (f" ({s['peak_memory_note']})" if s.get("peak_memory_note") else ""),
        f"dropped    {100 * s['dropped_token_fraction']:.2f}% of routed slots",
        f"paging     {s['page_moves_per_step']:.1f} page moves per step",
        f"cache      {'n/a (no cached groups)' if hit is None else f'{100 * hit:.1f}% hit rate'}",
    ]
    if s.get("batch"):
        lines.append(f"batch      {s['batch']['text']}")
    if s.get("groups"):
        g = s["groups"]
        where = f"every GPU's in {Path(s['run_dir']) / g['file']}" if s.get("run_dir") else g["file"]
        lines.append(f"groups     {g['rank0'] or g['note']}  ({where}"
                     + (f"; {g['note']})" if g["rank0"] and g["note"] else ")"))
    if s.get("memory_breakdown_bytes"):
        parts = " | ".join(f"{k} {format_bytes(v)}" for k, v in s["memory_breakdown_bytes"].items() if v > 0)
        lines.append(f"memory by  {parts}  (the fullest rank, each part at its most)")
    if s.get("pipeline"):
        p = s["pipeline"]
        lines.append(f"pipeline   {p['stages']} stages x {p['chunks']} chunks, {p['micro_batches']} micro-batches: "
                     f"bubble {100 * p['bubble_fraction']:.1f}% of the step on the idlest stage, sends "
                     f"of {ms(max(p['send_s']))} each, {format_bytes(p['send_bytes_per_gpu'])} per GPU a step, stage 0 "
                     f"holds {p['in_flight'][0]} in flight")
    if s.get("loss_first") is not None:
        lines.append(f"loss       {s['loss_first']:.4f} -> {s['loss_last']:.4f}")
    if s.get("wire_bytes_by_level"):
        wire = " | ".join(f"{k} {format_bytes(v)}" for k, v in s["wire_bytes_by_level"].items())
        lines.append(f"wire       {wire}  (per step on every link of a level, headers included)")
    if s.get("fitted_share") is not None:
        lines.append(f"fitted     {100 * s['fitted_share']:.1f}% of the simulated step from fitted constants")
    if s.get("utilization_by_level"):
        util = " | ".join(f"{k} {100 * v:.1f}%" for k, v in s["utilization_by_level"].items())
        lines.append(f"links      utilization {util} ({s.get('network_model')} network model)")
    if s.get("hottest_links"):
        hot = ", ".join(f"{h['name']} {100 * h.get('utilization', 0):.0f}%" for h in s["hottest_links"][:3])
        lines.append(f"hottest    {hot}")
    if s.get("exposed_s") is not None:
        lines.append(f"exposed    {ms(s['exposed_s'])} of the step with the compute stream idle (comm, copies, waits)")
    if s.get("representative_slice"):  # sim.representative_slice: how the step was evaluated
        r = s["representative_slice"]
        how = (f"evaluated on a representative slice of {r['gpus']} of {r['of_gpus']} GPUs ({r['slices']} alike)"
               if r["used"] else f"full simulation ({r['reason']})")
        lines.append(f"slice      {how}; {r['routing']}")
    if s.get("faults"):
        for f in s["faults"]:
            lost = f", {f['time_lost_s']:.1f} s of training lost" if f["time_lost_s"] else ""
            lines.append(f"fault      step {f['step']}: {f['kind']} {f['target']} -> {f['action']}{lost}")
    if s.get("memory_verdict"):
        lines.append(f"WARNING    {s['memory_verdict']}")
    elif s.get("fits_in_device_memory") is False:
        lines.append(f"WARNING    peak memory exceeds the profile's {s['device_memory_bytes'] / 1e9:.0f} GB device memory")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
