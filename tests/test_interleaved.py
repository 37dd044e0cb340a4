"""Interleaved 1F1B (``pp_schedule=interleaved-1f1b``, ``parallel.pp_virtual=v``): each
rank runs v chunks of layers, Megatron's virtual pipeline (oases/pipeline/runner.py).

* Against the unsharded run (tests/support/parity.py's ``run_case``, its tolerances:
  losses and the first gradient norm rtol 1e-5, gradients rtol 1e-4 / atol 1e-6), dropout 0.
* Against 1f1b at pp x v stages, dropout on: a chunk draws from the random streams the
  stage of its layers has there (oases.parallel.random.ChunkRNG), in the same
  micro-batch order, and runs the same kernels on the same rows, so the losses and
  gradient norms are bit for bit those of 1f1b (compared with rtol 0), and so are the
  parameters after three Adam steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.parity import MBS, SEQ, WORLD, run_case, stage


def _cfg(arch: str, engine: tuple, kind: str, pp: int, tp: int, *extra: str, virtual: int = 2,
         layers: int = 4, world: int = WORLD, accum: int = 0):
    from oases.config import load_config

    name = "gpt-tiny" if arch == "gpt" else "llama-tiny"
    return load_config(None, [
        f"model.name={name}", f"model.seq_len={SEQ}", "model.dropout=0.0",
        f"model.n_layer={layers}",
        f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.schedule={engine[0]}",
        f"parallel.recompute={engine[1]}", f"parallel.pp_schedule={kind}",
        f"parallel.pp_virtual={virtual if kind == 'interleaved-1f1b' else 1}",
        f"train.grad_accum={accum or 2 * pp}", f"train.micro_batch_size={MBS}",
        "train.warmup_steps=0", "train.lr=1e-3", "data.kind=synthetic",
        "wandb.mode=disabled", *extra]).validate(world)


def _unsharded_body(rank: int, cases: list) -> None:
    from oases.parallel.layout import stages_layout, uniform_layout

    for arch, engine, pp, tp, virtual, layers, extra, *more in cases:
        cfg = _cfg(arch, engine, "interleaved-1f1b", pp, tp, *extra, virtual=virtual,
                   layers=layers, accum=more[0] if more else 0)
        layout = (stages_layout(more[1], WORLD, layers, "test", MBS) if len(more) > 1
                  else uniform_layout(WORLD, pp, tp, cfg.model.n_layer))
        run_case(rank, cfg, layout, 2,
                 f"interleaved v{virtual} {arch} {engine} pp{pp} tp{tp} {extra} {more}")


@pytest.mark.slow  # ~7 s; the dropout case below is interleaving's fast-tier check
def test_interleaved_matches_unsharded():
    # every case runs under the NCCL point-to-point emulation (run_distributed's default):
    # a receive posted out of the peer's order would hang and fail it; m = pp and 3 pp too
    run_distributed(_unsharded_body, world=WORLD, tp=None, args=([
        ("gpt", ("megatron", "none"), 2, 2, 2, 4, ()),
        ("llama", ("oases", "fine"), 2, 2, 2, 4, ()),
        ("gpt", ("oases", "none"), 2, 2, 2, 4, (), 2),
        ("llama", ("megatron", "selective"), 2, 2, 2, 4, (), 6),
    ],))


def test_chunks_are_the_even_split_and_a_plan_of_other_ranges_is_refused():
    from oases.errors import ConfigError
    from oases.parallel.layout import stages_layout, uniform_layout

    lay = uniform_layout(4, 2, 2, 8)
    assert [lay.chunks(s, 2) for s in (0, 1)] == [((0, 2), (4, 6)), ((2, 4), (6, 8))]
    assert lay.chunks(1, 4) == ((1, 2), (3, 4), (5, 6), (7, 8))
    uneven = stages_layout([{"layers": [0, 5], "dp": 1, "tp": 2},
                            {"layers": [5, 8], "dp": 1, "tp": 2}], 4, 8, "p.yaml", 4)
    with pytest.raises(ConfigError, match=r"^interleaved-1f1b runs each stage's layers as 2 "
                       r"equal chunks at the stage's TP degree; stage 0 has layers 0-4 "
                       r"\(the even split gives 0-3\)$"):
        uneven.chunks(0, 2)
    degrees = stages_layout([{"layers": [0, 4], "dp": 1, "tp": 2, "degrees": [2, 1] * 4},
                             {"layers": [4, 8], "dp": 1, "tp": 2}], 4, 8, "p.yaml", 4)
    with pytest.raises(ConfigError, match=r"stage 0 has layers 0-3 at degrees \[2, 1,"):
        degrees.chunks(1, 2)
    with pytest.raises(ConfigError, match=r"^6 layers do not divide into pp=2 x pp_virtual=2"):
        uniform_layout(4, 2, 2, 6).chunks(0, 2)


def _record_body(rank: int, args: tuple, out: str) -> None:
    """Three steps of one layout; losses and norms (every rank alike) and this rank's
    parameters after them, whole (tp 1, ZeRO's ranges gathered), written by DP rank 0."""
    from oases.parallel.layout import uniform_layout
    from oases.runtime.data import ValBatches
    from oases.runtime.step import evaluate, train_step

    arch, engine, kind, pp, dp, extra, layers, accum = args
    cfg = _cfg(arch, engine, kind, pp, 1, *extra, layers=layers, world=pp * dp, accum=accum)
    ctx, model, ts, batches = stage(cfg, uniform_layout(pp * dp, pp, 1, layers))
    steps = [train_step(ts, batches, cfg.train.lr) for _ in range(3)]
    val = ValBatches(f"{out}/val.bin", "uint16", SEQ, cfg.model.vocab_size, MBS, ctx.dp_rank,
                     ctx.dp, 3)  # through every chunk (PipelineRunner.forward_only)
    val_loss = evaluate(model, val, cfg, ctx, ts.pipe)
    with ts.reducer.ownership.unsharded(ts.opt, model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if ctx.dp_rank == 0:
        torch.save({"steps": steps, "params": params, "val": val_loss},
                   f"{out}/{kind}-rank{rank}.pt")


def _against_1f1b(tmp_path, arch, engine, pp, virtual, dp, zero):
    """interleaved-1f1b at pp x v against 1f1b at pp*v stages, dropout on."""
    from tests.support.zero_levels import PARAM_ATOL

    extra = ("model.dropout=0.1", f"parallel.zero={zero}")
    layers = 2 * pp * virtual
    rows = np.random.default_rng(0).integers(0, 256, 3 * dp * MBS * (SEQ + 1) + 5)
    rows.astype(np.uint16).tofile(tmp_path / "val.bin")  # two whole batches, one partial
    run_distributed(_record_body, world=pp * virtual * dp, tp=None, args=(
        (arch, engine, "1f1b", pp * virtual, dp, extra, layers, 2 * pp * virtual),
        str(tmp_path)))
    run_distributed(_record_body, world=pp * dp, tp=None, args=(
        (arch, engine, "interleaved-1f1b", pp, dp, extra, layers, 2 * pp * virtual),
        str(tmp_path)))

    def read(kind):
        files = sorted(tmp_path.glob(f"{kind}-rank*.pt"))
        runs = [torch.load(f) for f in files]
        assert len({r["val"] for r in runs}) == 1, [r["val"] for r in runs]  # every rank's
        return runs[0]["steps"] + [runs[0]["val"]], \
            {n: p for r in runs for n, p in r["params"].items()}

    (*ref_steps, ref_val), ref_params = read("1f1b")
    (*steps, val), params = read("interleaved-1f1b")
    what = f"interleaved v{virtual} vs 1f1b at pp {pp * virtual}: {arch} {engine} zero{zero}"
    losses, norms = zip(*steps)
    ref_losses, ref_norms = zip(*ref_steps)
    assert losses == ref_losses, (what, losses, ref_losses)
    assert abs(val - ref_val) <= 1e-6 * ref_val, (what, val, ref_val)  # the norms' rounding
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6,
                               atol=0, msg=lambda m: f"{what}: gradient norms: {m}")
    assert sorted(params) == sorted(ref_params), what
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=0, atol=PARAM_ATOL,
                                   msg=lambda m: f"{what}: {name}: {m}")


def test_interleaved_with_dropout_is_1f1b_at_pp_times_v(tmp_path):
    _against_1f1b(tmp_path, "gpt", ("megatron", "none"), 2, 2, 1, 0)


@pytest.mark.slow
def test_interleaved_pp4_sp_and_zero1_match_unsharded():
    run_distributed(_unsharded_body, world=WORLD, tp=None, args=([
        ("llama", ("megatron", "full"), 4, 1, 2, 8, ()),
        ("gpt", ("oases", "full"), 4, 1, 2, 8, ()),
        ("gpt", ("megatron", "selective"), 2, 1, 4, 8, ()),            # v = 4
        ("llama", ("oases", "fine"), 2, 2, 2, 4, ("parallel.sequence_parallel=true",)),
        ("gpt", ("oases", "fine"), 2, 1, 2, 4, ("parallel.zero=1",)),  # dp 2
        # stages of different meshes: every boundary, the wraparound too, a cross-mesh
        # reshard (tp 2 -> dp 2 and back)
        ("llama", ("megatron", "none"), 2, 2, 2, 4, (), 4,
         [{"layers": [0, 2], "dp": 1, "tp": 2}, {"layers": [2, 4], "dp": 2, "tp": 1}]),
    ],))


@pytest.mark.slow  # eight processes for the 1f1b reference
@pytest.mark.parametrize("arch,engine,zero", [("gpt", ("megatron", "none"), 1),
                                              ("llama", ("oases", "fine"), 3)])
def test_interleaved_with_dropout_and_zero_is_1f1b_at_pp_times_v(tmp_path, arch, engine, zero):
    _against_1f1b(tmp_path, arch, engine, 2, 2, 2, zero)


_RUN = ["model.name=gpt-tiny", f"model.seq_len={SEQ}", "model.n_layer=4", "parallel.pp=2",
        "parallel.tp=1", "parallel.schedule=megatron", "train.grad_accum=4",
        "train.micro_batch_size=2", "train.steps=4", "train.warmup_steps=0",
        "data.kind=synthetic", "data.val_path=", "checkpoint.interval=2",
        "wandb.mode=disabled", "resume=auto"]
_INTERLEAVED = ["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual=2"]


@pytest.mark.slow  # two whole runs
def test_an_interleaved_run_resumes_exactly(tmp_path):
    """Saved at step 2 and resumed: every chunk's random streams come back (dropout on),
    so steps 3 and 4 are the uninterrupted run's bit for bit."""
    from tests.support.loop import records, train_workers
    from tests.support.runs import resume_copy

    args = [*_RUN, *_INTERLEAVED, "model.dropout=0.1"]
    a = tmp_path / "a"
    train_workers(a, 2, args)
    b = resume_copy(a, tmp_path / "b")
    train_workers(b, 2, args)
    ra, rb = records(a), records(b)
    assert [rb[s]["loss"] for s in (3, 4)] == [ra[s]["loss"] for s in (3, 4)], (ra, rb)


@pytest.mark.slow  # three whole runs
def test_a_checkpoint_resumes_across_interleaving(tmp_path):
    """1f1b -> interleaved-1f1b and back at pp=2 (dropout 0: the two hold different
    layers per rank, so their random streams differ): steps 3 and 4 give the
    uninterrupted run's losses within rtol 1e-6 (the same kernels per layer; only the
    gradient norm's sum runs in another order, which the clip coefficient carries)."""
    from tests.support.loop import records, train_workers
    from tests.support.runs import resume_copy

    a = tmp_path / "a"
    train_workers(a, 2, _RUN)
    b = resume_copy(a, tmp_path / "b")
    train_workers(b, 2, [*_RUN, *_INTERLEAVED])
    c = tmp_path / "c"
    train_workers(c, 2, [*_RUN, *_INTERLEAVED])
    d = resume_copy(c, tmp_path / "d")
    train_workers(d, 2, _RUN)
    ra, rb, rc, rd = records(a), records(b), records(c), records(d)
    for step in (3, 4):
        for want, got in ((ra, rb), (rc, rd)):
            assert abs(got[step]["loss"] - want[step]["loss"]) <= 1e-6 * want[step]["loss"], \
                (step, want[step]["loss"], got[step]["loss"])


def test_the_start_up_line_names_each_ranks_chunks():
    from oases.parallel.layout import uniform_layout

    assert uniform_layout(4, 2, 1, 8).describe(2) == (
        "stage 0: layers 0-1, 4-5 dp 2 x tp 1 | stage 1: layers 2-3, 6-7 dp 2 x tp 1")
    assert uniform_layout(4, 2, 1, 8).describe() == (
        "stage 0: layers 0-3 dp 2 x tp 1 | stage 1: layers 4-7 dp 2 x tp 1")


@pytest.mark.slow  # two whole runs
def test_a_plan_file_runs_interleaved(tmp_path):
    """A plan's even stages (what the layout search proposes for interleaved-1f1b) run
    as the run without a plan does, bit for bit."""
    from tests.support.loop import records, train_workers

    plan = tmp_path / "plan.yaml"
    plan.write_text("stages:\n  - {layers: [0, 2], dp: 1, tp: 1}\n"
                    "  - {layers: [2, 4], dp: 1, tp: 1}\n"
                    "pp_schedule: interleaved-1f1b\npp_virtual: 2\n")
    a, b = tmp_path / "a", tmp_path / "b"
    train_workers(a, 2, [*_RUN, *_INTERLEAVED, "model.dropout=0.1"])
    train_workers(b, 2, [*_RUN, *_INTERLEAVED, "model.dropout=0.1", f"parallel.plan={plan}"])
    ra, rb = records(a), records(b)
    assert [rb[s]["loss"] for s in range(1, 5)] == [ra[s]["loss"] for s in range(1, 5)]
