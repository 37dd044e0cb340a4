"""Context parallelism inside the model (models/parallelize.py ``Parallelism.cp_group``).

Parity: every rank builds the model from the same seed and runs forward and backward on
its head-tail tokens of the same batch (ids and targets sharded with
``shard_sequence``, the documents of the whole rows in the model's slot). The
token-weighted mean of the cp ranks' losses equals the unsharded model's loss on the
whole batch, and each parameter's gradient, from a backward seeded with the rank's
share of the counted targets and summed over the cp group, equals the unsharded
gradient (this rank's TP shard of it): GPT (learned positions, tied head) and LLaMA (RoPE, GQA), at cp=2, cp=4
and tp=2 x cp=2, with documents crossing the chunk boundaries (positions running on
or restarting at each document). Targets are ignored unevenly, so the ranks' counts
differ and a plain mean of their losses would fail. Under NCCL's point-to-point
semantics (tests/support/distributed.py's default).

Tolerance: fp32 on both sides; the ring sums each query's keys block by block and
merges the blocks by log-sum-exp, and dk/dv sum the ranks' shares around the ring,
where the reference sums in one pass: a reordering of fp32 sums of at most T = 32 terms
per attention (at most T u = 1.9e-6 of their magnitude, u = 6e-8), carried through 4
layers, the head and the loss: about 1e-5. We allow 1e-5 of each parameter's
max|reference gradient| (the largest seen: 8.9e-7, LLaMA with documents at cp=2) and
1e-6 of the loss (the largest seen: 8.5e-8). Positions taken local (0..T/cp-1)
instead of global put the loss off by 3.6e-3 (GPT) and 1.6e-5 (LLaMA) of itself;
documents dropped from the ring by 3.0e-3; restarted positions sliced instead of
sharded by 9.7e-4.

Weights: the ranks' backward is seeded with their shares n_r / N of the counted targets
(as oases.overlap.loss_weights seeds DP replicas): under cp that is required, since the
ring's backward brings each rank's kv the gradients of the other ranks' losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from oases.models import arch_class, build_model
from oases.models.common import CausalLM
from oases.models.documents import Documents
from oases.models.parallelize import Parallelism, build, parallelize
from oases.parallel.comm import group_rank, group_size
from oases.parallel.cp_chunks import shard_sequence
from oases.parallel.loss import IGNORE_INDEX
from oases.parallel.sharding import shard
from tests.support.configs import tiny_config
from tests.support.distributed import run_distributed

SEED = 7
B, T = 2, 32          # T: 2 cp chunks of 4 tokens at cp 4, of 8 at cp 2
EOS = 3
LOSS_RTOL = 1e-6      # see the module doc
GRAD_RTOL = 1e-5      # of the parameter's max|reference gradient|
# each row's EOS positions: documents span chunks (cp 2: 8 tokens, cp 4: 4) and ranks
EOS_AT = ([5, 13, 22], [10, 27])

# (model, documents: None | "eos" | "reset" (positions restart at each), recompute)
CASES = {  # (tp, cp) -> cases
    (1, 2): [("gpt-tiny", None, "none"), ("llama-tiny", None, "none"),
             ("gpt-tiny", "eos", "none"), ("llama-tiny", "eos", "none"),
             ("gpt-tiny", "reset", "none"), ("llama-tiny", "reset", "full"),
             ("llama-tiny", "reset", "selective")],
    (1, 4): [("gpt-tiny", "eos", "none"), ("llama-tiny", "reset", "none")],
    (2, 2): [("gpt-tiny", None, "none"), ("llama-tiny", "eos", "none")],
}
LAYOUTS = {2: [(1, 2)], 4: [(1, 4), (2, 2)]}  # world -> its (tp, cp) layouts, one run


def _cfg(name: str, *extra: str):
    return tiny_config(*extra, world=1, synthetic=False, name=name, dropout=0, seq_len=T)


def _batch(vocab: int, docs: str | None):
    """ids, targets (some ignored, more in the first half: the ranks' counts differ)
    and the whole rows' documents."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(EOS + 1, vocab, (B, T), generator=g)
    for row, at in enumerate(EOS_AT):
        ids[row, at] = EOS
    y = torch.randint(0, vocab, (B, T), generator=g)
    y[0, 2:9] = IGNORE_INDEX
    y[1, 17:19] = IGNORE_INDEX
    return ids, y, None if docs is None else Documents.from_eos(ids, EOS, docs == "reset")


def _groups(world: int, tp: int, cp: int):
    """This rank's (tp group, cp group): rank = c * tp + t; a cp group holds the ranks of
    one TP rank. Every rank makes every group, in the same order."""
    rank, tps, cps = dist.get_rank(), {}, {}
    for c in range(cp):
        members = [c * tp + t for t in range(tp)]
        g = dist.new_group(members) if tp > 1 else None
        tps.update({m: g for m in members})
    for t in range(tp):
        members = [c * tp + t for c in range(cp)]
        g = dist.new_group(members)
        cps.update({m: g for m in members})
    return tps[rank], cps[rank]


class _CountExchanges:
    """Counts the ring's exchanges (each one ``batch_isend_irecv`` on the cp group)."""

    def __enter__(self):
        self.n, self.orig = 0, dist.batch_isend_irecv

        def counted(ops):
            self.n += 1
            return self.orig(ops)
        dist.batch_isend_irecv = counted
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self.orig


def _reference(cls, cfg, ids, y, docs):
    model = build(cls, cfg.model, cfg.padded_vocab(1), Parallelism(), seed=SEED)
    with model.documents.use(docs):
        loss = model(ids, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model


def _check_case(tp_group, cp_group, case) -> None:
    name, docs_mode, recompute = case
    what = f"{case} at tp={group_size(tp_group)} cp={group_size(cp_group)}"
    cfg = _cfg(name)
    cls = arch_class(cfg.model.arch)
    tp, cp, r = group_size(tp_group), group_size(cp_group), group_rank(cp_group)
    ids, y, docs = _batch(cfg.model.vocab_size, docs_mode)
    ref_loss, ref_grads, ref = _reference(cls, cfg, ids, y, docs)
    # the documents change the loss, and so does restarting learned positions at them
    # (not RoPE's: its scores see position differences, the same within a document)
    others = [] if docs is None else [None]
    if docs_mode == "reset" and ref.learned_positions:
        others.append(Documents(docs.doc, False))
    for other in others:
        with torch.no_grad(), ref.documents.use(other):
            assert abs(ref(ids, y).item() - ref_loss.item()) > 1e-3, (what, other)

    model = build(cls, cfg.model, cfg.padded_vocab(tp),
                  Parallelism(tp_group=tp_group, cp_group=cp_group, recompute=recompute),
                  seed=SEED)
    yl = shard_sequence(y, cp, r)
    n = CausalLM.loss_tokens(yl).float()
    N = n.clone()
    dist.all_reduce(N, group=cp_group)
    with _CountExchanges() as ex:
        with model.documents.use(docs):  # backward too: recompute=full reads them
            loss = model(shard_sequence(ids, cp, r), yl)
            # seeded with the rank's share: the ring's backward brings this rank's kv
            # the other ranks' gradients, already weighted by their shares
            (loss * (n / N)).backward()
    # per layer, forward: cp-1 kv blocks; backward: cp-1 kv blocks and cp accumulators;
    # recompute=full runs each layer's forward again in backward, selective does not
    L = cfg.model.n_layer
    assert ex.n == L * ((cp - 1) * (1 + (recompute == "full")) + 2 * cp - 1), (what, ex.n)

    counts = [torch.zeros(()) for _ in range(cp)]
    dist.all_gather(counts, n, group=cp_group)
    assert len(set(c.item() for c in counts)) > 1, (what, counts)  # weights matter
    got = loss.detach() * (n / N)
    dist.all_reduce(got, group=cp_group)
    assert abs(got - ref_loss) <= LOSS_RTOL * abs(ref_loss), f"{what}: loss {got} vs {ref_loss}"

    tp_rank = group_rank(tp_group)
    for pname, p in model.named_parameters():
        g = p.grad.contiguous()
        dist.all_reduce(g, group=cp_group)
        rank, size = getattr(p, "tp_coords", (tp_rank, tp))
        want = shard(ref_grads[pname], getattr(p, "tp_spec", None), rank, size)
        err, scale = (g - want).abs().max().item(), want.abs().max().item()
        assert err <= GRAD_RTOL * scale, (f"{what}: {pname} gradient off by {err:.2e} "
                                          f"(max|ref| {scale:.2e})")


def _parity_body(rank: int, world: int) -> None:
    torch.set_float32_matmul_precision("highest")
    layouts = [(tp, cp, _groups(world, tp, cp)) for tp, cp in LAYOUTS[world]]
    for tp, cp, (tp_group, cp_group) in layouts:
        for case in CASES[(tp, cp)]:
            _check_case(tp_group, cp_group, case)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: larger
def test_cp_model_matches_unsharded(world):
    """world 2: cp=2; world 4: cp=4, then tp=2 x cp=2."""
    run_distributed(_parity_body, world=world, tp=None, args=(world,))


def _refusal_body(rank: int) -> None:
    group = dist.new_group([0, 1])

    def refused(par: Parallelism, match: str, *extra: str, name: str = "gpt-tiny"):
        cfg = _cfg(name, *extra)
        with torch.device("meta"):
            model = arch_class(cfg.model.arch)(cfg.model, cfg.padded_vocab(1))
        with pytest.raises(ValueError, match=match) as e:
            parallelize(model, par)
        assert "\n" not in str(e.value)

    par = Parallelism(cp_group=group)
    refused(par, r"cp=2\) with model.sliding_window=8: ring attention has no sliding window",
            "model.arch=mistral", "model.sliding_window=8", name="llama-tiny")
    refused(Parallelism(cp_group=group, compile="strict"),
            r"cp=2\) with parallel.compile='strict': the ring's exchanges break")
    refused(Parallelism(cp_group=group, degrees=(1,) * 8),
            r"cp=2\) with per-block TP degrees")
    # a window no sequence reaches is no window: taken
    cfg = _cfg("llama-tiny", "model.arch=mistral", f"model.sliding_window={T}")
    with torch.device("meta"):
        model = arch_class(cfg.model.arch)(cfg.model, cfg.padded_vocab(1))
    parallelize(model, par)
    assert model.layers[0].attn.cp_group is group and model.documents.cp == (2, rank)
    # decoding attends a cache of whole sequences, never the ring: refused by name
    built = build_model(_cfg("gpt-tiny").model, 256, cp_group=group)
    with pytest.raises(ValueError, match=r"^decode runs on whole sequences: the model is "
                       r"context-parallel \(cp=2\)"):
        built.new_kv_cache(1, 8)


def test_cp_refuses_what_the_ring_cannot_do():
    run_distributed(_refusal_body, world=2, tp=None)
