"""Packed documents: attention stays inside each document and positions restart at each,
under every engine and layout (models/documents.py; the engines put each sub-batch's
documents in the model's slot).

* One process: a packed row's logits are each document's logits alone (GPT: learned
  positions, LLaMA: RoPE), and the documents change the logits where a row holds two.
* Layouts: a token corpus of EOS-ended documents (``data.reset_attention_at_eos``,
  ``data.reset_position_ids``) trains at pp x tp x dp layouts, both engines, every
  recompute mode, per-block degrees (rows split between subgroups), sequence
  parallelism, ZeRO-3 and ``overlap_fb`` like one unsharded process on the same global
  batch (tests/support/parity.py's ``run_case``: losses rtol 1e-5, gradients rtol 1e-4 /
  atol 1e-6, the reasons there). The unsharded run itself is checked to differ from
  the same run without documents, so a layout that dropped them would fail.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from oases.config import load_config
from oases.models.documents import Documents, DocumentSlot
from tests.support.distributed import run_distributed
from tests.support.parity import MBS, SEQ, WORLD, run_case, unsharded_reference
from tests.support.zero_levels import PARAM_ATOL, run_levels

VOCAB = 256


def test_documents_numbers_positions_and_pieces():
    ids = torch.tensor([[5, 0, 7, 8, 0, 9], [1, 2, 3, 4, 5, 6]])
    d = Documents.from_eos(ids, 0, reset_positions=True)
    assert d.doc.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert d.positions().tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert Documents.from_eos(ids, 0).positions() is None  # positions 0..T-1
    starts = torch.tensor([[True, False, True, False, False, True]])
    assert Documents.from_starts(starts, True).positions().tolist() == [[0, 1, 0, 1, 2, 0]]
    m = d.mask()[0, 0]
    assert m[3].tolist() == [False, False, True, True, False, False]  # token 3: doc 1 so far
    assert d.mask()[1, 0].equal(torch.ones(6, 6, dtype=torch.bool).tril())
    a, b = d.chunk(2)
    assert a.doc.tolist() == [d.doc[0].tolist()] and b.positions().tolist() == [list(range(6))]
    slot = DocumentSlot()
    slot.home, slot.pieces = 2, lambda t: (1, 2)  # this rank's degree-1 subgroup: rows 1
    with slot.use(d):
        assert slot.mask(2) is d.mask() and slot.positions(1).tolist() == [list(range(6))]
        with pytest.raises(ValueError, match="above the stage's home degree"):
            slot.at(4)
    assert slot.current is None and slot.mask(2) is None


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_packed_row_is_each_document_alone(arch):
    """Positions restart (learned for GPT, rotary for LLaMA) and attention stops at each
    EOS: each document's logits in a packed row are its logits alone."""
    from oases.models import build_model

    name = "gpt-tiny" if arch == "gpt" else "llama-tiny"
    cfg = load_config(None, [f"model.name={name}", "model.seq_len=24", f"model.vocab_size={VOCAB}",
                             "model.dropout=0.0"]).validate()
    model = build_model(cfg.model, cfg.padded_vocab_size, None, seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, VOCAB, (1, n), generator=gen) for n in (7, 11, 6)]
    for doc in docs:
        doc[0, -1] = 0  # each ends with its EOS
    row = torch.cat(docs, dim=1)  # (1, 24)
    with torch.no_grad():
        with model.documents.use(Documents.from_eos(row, 0, reset_positions=True)):
            packed = model.full_logits(row)
        plain = model.full_logits(row)
        start = 0
        for doc in docs:
            n = doc.shape[1]
            torch.testing.assert_close(packed[:, start:start + n], model.full_logits(doc),
                                       rtol=1e-4, atol=1e-5)
            start += n
    assert not torch.allclose(packed[:, 7:], plain[:, 7:], atol=1e-3)  # the documents matter


def corpus(path: Path) -> Path:
    """EOS (0) ended documents of 3-12 random tokens: about two per 16-token row."""
    rng = np.random.default_rng(7)
    out: list[int] = []
    while len(out) < 6000:
        out += list(rng.integers(1, VOCAB, rng.integers(2, 12))) + [0]
    np.asarray(out, dtype=np.uint16).tofile(path)
    return path


def _cfg(data: Path, arch: str, schedule: str, recompute: str, pp: int, tp: int, *extra: str,
         world: int = WORLD):
    name = "gpt-tiny" if arch == "gpt" else "llama-tiny"
    return load_config(None, [
        f"model.name={name}", "model.n_layer=2", f"model.seq_len={SEQ}", "model.dropout=0.0",
        f"model.vocab_size={VOCAB}", f"parallel.pp={pp}", f"parallel.tp={tp}",
        f"parallel.schedule={schedule}", f"parallel.recompute={recompute}", "train.grad_accum=3",
        f"train.micro_batch_size={MBS}", "train.warmup_steps=0", "train.lr=1e-3",
        "data.kind=tokens", f"data.train_path={data}", "data.eos_id=0",
        "data.reset_attention_at_eos=true", "data.reset_position_ids=true",
        "wandb.mode=disabled", *extra]).validate(world)


def _body(rank: int, data: Path, cases: list, world: int = WORLD) -> None:
    from oases.parallel.layout import stages_layout, uniform_layout

    for arch, schedule, recompute, pp, tp, extra, *stages in cases:
        cfg = _cfg(data, arch, schedule, recompute, pp, tp, *extra, world=world)
        layout = (stages_layout(stages[0], world, cfg.model.n_layer, "test", cfg.pipeline_batch)
                  if stages else uniform_layout(world, pp, tp, cfg.model.n_layer))
        run_case(rank, cfg, layout, 2, f"documents {arch} {schedule}/{recompute} pp{pp} tp{tp} "
                                       f"{extra} {stages}")


def test_documents_change_the_unsharded_run(tmp_path):
    """The reference the layouts match is not the run without documents."""
    data = corpus(tmp_path / "docs.bin")
    with_docs = unsharded_reference(_cfg(data, "gpt", "megatron", "none", 1, 1), 1)[0]
    without = unsharded_reference(_cfg(data, "gpt", "megatron", "none", 1, 1,
                                       "data.reset_attention_at_eos=false",
                                       "data.reset_position_ids=false"), 1)[0]
    assert abs(with_docs[0] - without[0]) > 1e-3, (with_docs, without)


# per-block degrees inside tp 4: the degree-1 and -2 blocks compute pieces of the rows
MIXED = [{"layers": [0, 2], "dp": 1, "tp": 4, "degrees": [2, 1, 4, 2]}]


def test_pipeline_and_tp_layouts_match_unsharded(tmp_path):
    run_distributed(_body, world=WORLD, tp=None, args=(corpus(tmp_path / "docs.bin"), [
        ("gpt", "megatron", "full", 2, 2, ()),
        ("llama", "oases", "fine", 2, 2, ()),
        ("gpt", "oases", "full", 1, 4, ("train.micro_batch_size=16",), MIXED),
    ]))


SLOW_CASES = {
    "sp-oases": ("llama", "oases", "fine", 1, 2, ("parallel.sequence_parallel=true",)),
    "sp-pp2-megatron": ("gpt", "megatron", "selective", 2, 2, ("parallel.sequence_parallel=true",)),
    "overlap_fb": ("gpt", "oases", "none", 2, 2, ("parallel.overlap_fb=true", "parallel.pp_schedule=eager-1f1b")),
    "compile": ("llama", "oases", "full", 1, 2, ("parallel.compile=true",)),
}
# each rank compiles the blocks itself: the compiled case runs at tp 2 alone (world 2),
# half the compiles of dp 2 x tp 2; documents under dp 2 are sp-oases' and ZeRO-3's
WORLDS = {"compile": 2}


@pytest.mark.slow  # make test runs them, make test-fast the layouts above
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_sp_zero3_overlap_fb_and_compile_match_unsharded(tmp_path, case):
    world = WORLDS.get(case, WORLD)
    run_distributed(_body, world=world, tp=None,
                    args=(corpus(tmp_path / "docs.bin"), [SLOW_CASES[case]], world))


def _zero_body(ctx, data: Path) -> None:
    """ZeRO-3 against ZeRO-0 (replicated, which the layouts above tie to the unsharded
    run) with documents, dp 2 x tp 2, 3 steps: tests/test_zero.py's run and tolerances."""
    docs = ("data.kind=tokens", f"data.train_path={data}", "data.eos_id=0",
            f"model.vocab_size={VOCAB}", "model.name=llama-tiny",
            "data.reset_attention_at_eos=true", "data.reset_position_ids=true")
    (ref_l, ref_n, ref_p, _), = run_levels(ctx, (0,), "oases", "fine", docs).values()
    (losses, norms, params, _), = run_levels(ctx, (3,), "oases", "fine", docs).values()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_l), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_n), rtol=1e-5, atol=0)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_p[name], rtol=0, atol=PARAM_ATOL, msg=name)


@pytest.mark.slow
def test_zero3_matches_replicated(tmp_path):
    run_distributed(_zero_body, world=4, tp=2, args=(corpus(tmp_path / "docs.bin"),))
