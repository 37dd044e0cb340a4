"""Initialisation scales with the pipeline stage: one rank's init time and peak host memory.

    .venv/bin/python -m benchmarks.init_scaling                 # llama-7b, tp=2 (no root)
    .venv/bin/python -m benchmarks.init_scaling --cases 0:8 24:32 --repeats 1

Per stage case ``a:b``, the 2 ranks of one stage's TP group (gloo, fresh processes)
each run ``oases.models.build_model(..., stage=(a, b))``; rank 0's build time (with
``init_parameters`` timed apart), peak RSS increase (``VmHWM`` reset before the
build) and parameter bytes are kept. A case whose 2 ranks would not fit in the free
memory is skipped; the whole model's (pp=1) time is extrapolated from the measured cases.
Targets: peak increase < 1.5x the rank's parameter bytes; t([0,16)) / t([0,8)) ~ 2.
More in benchmarks/README.md, section init_scaling.py. Writes benchmarks/results/init.{md,json}.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.machine import machine_info
from benchmarks.lib.ranks import init_gloo, reset_peak, spawn_ranks, status_kib, write_result

REPO = driver.REPO

GIB = 2**30


def _worker(rank: int, world: int, store_path: str, model_name: str, stage: tuple,
            result_dir: str) -> None:
    import torch
    import torch.distributed as dist

    init_gloo(rank, world, store_path)
    from oases import models
    from oases.config import load_config

    cfg = load_config(None, [f"model.name={model_name}", f"parallel.tp={world}"]).validate(world)
    tp_group = dist.group.WORLD
    timing = {"init_s": 0.0}
    # init_parameters as the module that builds the model calls it (timed apart)
    builder = sys.modules[models.build_model.__module__]
    builder = sys.modules[getattr(builder, "build", models.build_model).__module__]
    orig_init = builder.init_parameters

    def timed_init(*a, **k):
        t = time.perf_counter()
        try:
            return orig_init(*a, **k)
        finally:
            timing["init_s"] += time.perf_counter() - t

    builder.init_parameters = timed_init
    dist.barrier()
    rss0 = status_kib("VmRSS")
    hwm_reset = reset_peak(strict=False)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    model = models.build_model(cfg.model, cfg.padded_vocab(world), tp_group, seed=cfg.seed,
                               stage=stage)
    build_s = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    hwm = status_kib("VmHWM")
    rss1 = status_kib("VmRSS")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    buf_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    dist.barrier()
    row = {"rank": rank, "stage": list(stage), "build_s": build_s,
           "cpu_user_s": ru1.ru_utime - ru0.ru_utime, "cpu_sys_s": ru1.ru_stime - ru0.ru_stime,
           "cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
           "params_drawn": sum(p.numel() for p in model.parameters()
                               if p.init_rule[0] == "normal"),
           "construct_s": build_s - timing["init_s"], "init_parameters_s": timing["init_s"],
           "rss_before_gib": rss0 * 1024 / GIB, "rss_after_gib": rss1 * 1024 / GIB,
           "peak_rss_gib": hwm * 1024 / GIB, "peak_increase_gib": (hwm - rss0) * 1024 / GIB,
           "hwm_reset": hwm_reset, "param_bytes": param_bytes, "params": n_params,
           "buffer_bytes": buf_bytes, "param_gib": param_bytes / GIB,
           "has_embed": model.embed is not None, "has_head": model.head is not None,
           "all_finite": finite}
    write_result(result_dir, rank, row)
    dist.destroy_process_group()


def run_case(model_name: str, stage: tuple, world: int = 2) -> list[dict]:
    """Each rank's figures for one stage case, from ``world`` fresh processes."""
    import torch.multiprocessing as mp  # deferred: the parent only spawns

    try:
        rows = spawn_ranks(_worker, world, model_name, tuple(stage))
    except mp.ProcessExitedException as e:  # SIGKILLed by the kernel: out of memory
        raise RuntimeError(f"stage {stage}: a worker exited ({e}; out of memory?)") from None
    return sorted(rows, key=lambda r: r["rank"])


def mem_available_gib() -> float:
    for ln in Path("/proc/meminfo").read_text().splitlines():
        if ln.startswith("MemAvailable:"):
            return int(ln.split()[1]) / 2**20
    return 0.0


def expected_stage_bytes(model_name: str, stage: tuple, tp: int) -> int:
    """Parameter bytes of one rank of the stage, from the meta-device model (no memory)."""
    from oases import models
    from oases.config import load_config

    cfg = load_config(None, [f"model.name={model_name}", f"parallel.tp={tp}"]).validate(tp)
    m = models.build_model(cfg.model, cfg.padded_vocab(tp), None, seed=None, device="meta",
                           stage=stage)
    return sum(p.numel() * p.element_size() for p in m.parameters()) // tp


def main(argv=None) -> int:
    p = driver.parser(__doc__)
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--cases", nargs="+", default=["0:4", "0:8", "24:32", "0:16"],
                   help="stages a:b (layers [a, b)) to build, in this order")
    p.add_argument("--repeats", type=int, default=3, help="fresh-process builds per case")
    p.add_argument("--max-gib", type=float, default=18.0,
                   help="skip a case whose 2 ranks would need more than this (estimate)")
    driver.report_flags(p, "init")
    args = p.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, out=args.out)
    from oases.config import load_config

    mcfg = load_config(None, [f"model.name={args.model}", "parallel.tp=2"]).validate(2).model
    n_layer = mcfg.n_layer
    cases = [tuple(int(v) for v in c.split(":")) for c in args.cases]
    meta = {"command": driver.command("benchmarks.init_scaling", argv), "machine": machine_info(), "model": args.model,
            "n_layer": n_layer, "tp": 2, "repeats": args.repeats,
            "loadavg_before": list(os.getloadavg()),
            "mem_available_gib_before": round(mem_available_gib(), 1)}
    results: dict = {}
    t_start = time.monotonic()
    for rep in range(args.repeats):
        for st in cases:
            key = f"{st[0]}:{st[1]}"
            est = expected_stage_bytes(args.model, st, 2)
            need = 2 * est * 1.35 / GIB + 1.0
            if need > min(args.max_gib, mem_available_gib() - 2.0):
                print(f"skip stage {st}: ~{need:.1f} GiB needed, "
                      f"{mem_available_gib():.1f} GiB available", flush=True)
                results.setdefault(key, {"stage": list(st), "skipped":
                                         f"needs ~{need:.1f} GiB for 2 ranks", "runs": []})
                continue
            load = os.getloadavg()[0]
            rows = run_case(args.model, st)
            r0 = rows[0]
            r0["loadavg_1min_before"] = round(load, 2)
            r0["rank1"] = {k: rows[1][k] for k in ("build_s", "peak_increase_gib", "param_bytes")}
            results.setdefault(key, {"stage": list(st), "runs": []})["runs"].append(r0)
            print(f"[{(time.monotonic() - t_start) / 60:4.1f} min] stage {st} r{rep}: "
                  f"build {r0['build_s']:.1f} s (init {r0['init_parameters_s']:.1f} s), "
                  f"params {r0['param_gib']:.2f} GiB, peak +{r0['peak_increase_gib']:.2f} GiB "
                  f"(abs {r0['peak_rss_gib']:.2f}), ratio "
                  f"{r0['peak_increase_gib'] / r0['param_gib']:.2f}", flush=True)
    for key, c in results.items():
        runs = c["runs"]
        if not runs:
            continue
        a, b = c["stage"]
        med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
        c.update(layers=b - a, has_embed=runs[0]["has_embed"], has_head=runs[0]["has_head"],
                 param_gib=runs[0]["param_gib"], params=runs[0]["params"],
                 params_drawn=runs[0]["params_drawn"],
                 build_s=med("build_s"), build_s_min=min(r["build_s"] for r in runs),
                 cpu_s=med("cpu_s"), cpu_user_s=med("cpu_user_s"), cpu_sys_s=med("cpu_sys_s"),
                 init_parameters_s=med("init_parameters_s"), construct_s=med("construct_s"),
                 peak_increase_gib=max(r["peak_increase_gib"] for r in runs),
                 peak_rss_gib=max(r["peak_rss_gib"] for r in runs),
                 rss_before_gib=med("rss_before_gib"))
        c["memory_ratio"] = c["peak_increase_gib"] / c["param_gib"]
        c["memory_ratio_abs"] = c["peak_rss_gib"] / c["param_gib"]
        c["s_per_layer"] = c["build_s"] / c["layers"]
        c["cpu_s_per_gparam_drawn"] = c["cpu_s"] / (c["params_drawn"] / 1e9)
    # whole model at pp=1 (parameters from the meta device; time extrapolated)
    full_bytes = expected_stage_bytes(args.model, (0, n_layer), 2)
    full_drawn = full_bytes // 4  # fp32: the rank's own parameters (it draws its shard only)
    extra: dict = {"pp1_param_gib_per_rank": full_bytes / GIB, "pp1_params_drawn": full_drawn}
    done = [c for c in results.values() if c.get("runs")]
    if len(done) >= 2:
        # least squares t = t0 + k * (full parameters drawn): proportional when t0 ~ 0
        for what in ("build_s", "cpu_s"):
            xs = [c["params_drawn"] / 1e9 for c in done]
            ys = [c[what] for c in done]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
            extra[f"fit_{what}"] = {"intercept_s": my - k * mx, "s_per_gparam": k,
                                    "pp1_extrapolated_s": (my - k * mx) + k * full_drawn / 1e9}
    s8, s16 = results.get("0:8", {}), results.get("0:16", {})
    if s8.get("runs") and s16.get("runs"):
        extra["ratio_16_over_8"] = {
            "wall_median": s16["build_s"] / s8["build_s"],
            "wall_min": s16["build_s_min"] / s8["build_s_min"],
            "cpu": s16["cpu_s"] / s8["cpu_s"],
            "layers": 2.0,
            "params_drawn": s16["params_drawn"] / s8["params_drawn"]}
    meta["elapsed_min"] = (time.monotonic() - t_start) / 60
    meta["loadavg_after"] = list(os.getloadavg())
    driver.save(driver.out_prefix(args, "init"),
                {"meta": meta, "cases": results, "derived": extra}, render)
    return 0


def render(out: Path, data: dict) -> None:
    """``<out>.md`` from the results JSON."""
    write_markdown(out.with_suffix(".md"), data["meta"], data["cases"], data["derived"])


def write_markdown(path: Path, meta: dict, results: dict, extra: dict) -> None:
    mi = meta["machine"]
    L = [f"# Initialisation scales with the pipeline stage ({meta['model']}, tp=2)", "",
         f"Machine: {mi['cpu']}, {mi['cores']} cores, {mi['mem_gib']} GiB, Linux {mi['kernel']}, "
         f"Python {mi['python']}, torch {mi['torch']}, oases {mi['git']}, {mi['date']}. "
         f"Load average before: {', '.join(f'{v:.2f}' for v in meta['loadavg_before'])}; after: "
         f"{', '.join(f'{v:.2f}' for v in meta['loadavg_after'])} (2 cores; the benchmark's own "
         f"2 ranks add ~2).", "",
         f"Command: `{meta['command']}` ({meta['elapsed_min']:.1f} min).", "",
         f"Each case spawns the 2 ranks of one stage's TP group (world 2, gloo, one thread "
         f"each) in fresh processes; each rank runs `oases.models.build_model(cfg.model, "
         f"cfg.padded_vocab(2), tp_group, seed=cfg.seed, stage=(a, b))` for `{meta['model']}` "
         f"({meta['n_layer']} layers). Figures of rank 0; time = median over "
         f"{meta['repeats']} builds, memory = the largest. Peak increase = VmHWM (reset before "
         f"the build) - VmRSS before the build; absolute peak includes the interpreter, torch "
         f"and gloo (~{statistics.median(c['rss_before_gib'] for c in results.values() if c.get('runs')):.2f} GiB).",
         "",
         "Time: wall = median (min) over the builds; CPU = user + sys seconds of the "
         "rank's process during the build (getrusage), which other tenants' load barely "
         "changes (wall time does: the load average before each build is in brackets). "
         "'drawn' = normal-initialised elements init_parameters generates: the rank's own "
         "shards.", "",
         "| stage (layers) | as in | parts | rank params | param GiB | build wall s: median (min) "
         "| every build s [load] | CPU s (user / sys) | drawn G | CPU s / G drawn "
         "| peak increase GiB | ratio (target < 1.5) | absolute peak GiB |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    n = meta["n_layer"]
    as_in = {}
    for key, c in results.items():
        a, b = c["stage"]
        w = b - a
        if n % w == 0 and a % w == 0:
            as_in[key] = f"pp={n // w} stage {a // w}"
    for key, c in results.items():
        if not c.get("runs"):
            L.append(f"| [{key.replace(':', ', ')}) | {as_in.get(key, '')} | | | | skipped: "
                     f"{c.get('skipped', '')} | | | | | | | |")
            continue
        parts = ", ".join(x for x, ok in (("embedding", c["has_embed"]),
                                          ("norm + head", c["has_head"])) if ok)
        ok = "PASS" if c["memory_ratio"] < 1.5 else "FAIL"
        every = ", ".join(f"{r['build_s']:.1f} [{r['loadavg_1min_before']:.1f}]" for r in c["runs"])
        L.append(f"| [{key.replace(':', ', ')}) | {as_in.get(key, '')} | {c['layers']} layers"
                 f"{' + ' + parts if parts else ''} | {c['params'] / 1e6:,.0f} M | "
                 f"{c['param_gib']:.2f} | {c['build_s']:.1f} ({c['build_s_min']:.1f}) | {every} | "
                 f"{c['cpu_s']:.1f} ({c['cpu_user_s']:.1f} / {c['cpu_sys_s']:.1f}) | "
                 f"{c['params_drawn'] / 1e9:.2f} | {c['cpu_s_per_gparam_drawn']:.1f} | "
                 f"{c['peak_increase_gib']:.2f} | **{c['memory_ratio']:.2f}x {ok}** | "
                 f"{c['peak_rss_gib']:.2f} |")
    L.append("")
    r = extra.get("ratio_16_over_8")
    if r:
        s8, s16 = results["0:8"], results["0:16"]
        user = s16["cpu_user_s"] / s8["cpu_user_s"]
        sys_ = s16["cpu_sys_s"] / s8["cpu_sys_s"]
        good = abs(user / r["params_drawn"] - 1) <= 0.15
        L += [f"**Time proportional to the stage**: [0, 16) has 2x the layers of [0, 8) (both with "
              f"the embedding: {r['params_drawn']:.2f}x the parameters to draw). Measured ratios "
              f"(medians): user CPU (the drawing and copying) **{user:.2f}x**, sys CPU (page "
              f"faults) {sys_:.2f}x, CPU {r['cpu']:.2f}x, wall time **{r['wall_median']:.2f}x** "
              f"({r['wall_min']:.2f}x on the minima). {'PASS' if good else 'FAIL'} for the work "
              f"oases does (user CPU within 15% of the work ratio); the wall time is "
              f"{100 * (r['wall_median'] / r['params_drawn'] - 1):+.0f}% off proportional "
              f"because the kernel time per parameter (sys: mostly page faults of fresh "
              f"memory) grows with the process's "
              f"footprint here (sys {s8['cpu_sys_s']:.1f} s -> {s16['cpu_sys_s']:.1f} s), "
              f"not because a rank builds more than its stage.", ""]
    for what, label in (("cpu_s", "CPU time"), ("build_s", "wall time")):
        f = extra.get(f"fit_{what}")
        if f:
            L.append(f"- {label} = {f['intercept_s']:.1f} s + {f['s_per_gparam']:.2f} s per "
                     f"billion parameters drawn (least squares over the cases; an intercept near "
                     f"0 = proportional to the stage).")
    f = extra.get("fit_build_s")
    if f:
        L += ["", f"**Extrapolation, not measured**: the whole model on one rank (pp=1 x tp=2) "
              f"would hold {extra['pp1_param_gib_per_rank']:.1f} GiB of parameters per rank (x 2 "
              f"ranks: more than this machine can spare next to its other tenants) and draw "
              f"{extra['pp1_params_drawn'] / 1e9:.2f} G parameters: ~"
              f"{f['pp1_extrapolated_s']:.0f} s of wall time by the fit above (~"
              f"{extra['fit_cpu_s']['pp1_extrapolated_s']:.0f} s of CPU), against "
              f"{results['0:8']['build_s']:.1f} s for a pp=4 stage-0 rank." if "0:8" in results
              and results["0:8"].get("runs") else ""]
    L += ["", "Why init costs what it costs: `init_parameters` draws only this rank's shard: "
          "each parameter is a stack of slices along its sharded dimension, each slice from its "
          "own generator seeded by (seed, name, slice), so the weights do not depend on the TP "
          "degree while a rank draws only its own (`oases/parallel/sharding.py`). A rank's time "
          "is therefore proportional to its own parameter count, and its transient memory is a "
          "buffer of 16 slices (row-parallel weights) or none (the rest are drawn in place). "
          "The sys time is page faulting of fresh memory (this machine is a VM).", "",
          "Raw numbers: `init.json`.", ""]
    path.write_text("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
