"""Parallelism is applied from outside: ``CausalLM(cfg, padded_vocab)`` is architecture only,
``parallelize`` cuts the stage and tags the parameters, ``materialize`` keeps the tags, and
``build`` gives the model the old in-model build gave (the parity tests in
tests/test_models.py and tests/test_pipeline_parity.py check the numbers at tp > 1)."""

from __future__ import annotations

import inspect

import torch

from oases.config import load_config
from oases.models import Llama, arch_class
from oases.models.blocks import TiedEmbedding
from oases.models.common import CausalLM
from oases.models.parallelize import Parallelism, build, materialize, parallelize
from oases.parallel.sharding import init_parameters


def _model_cfg(name: str = "gpt-tiny"):
    return load_config(None, [f"model.name={name}", "model.seq_len=32"]).validate(1)


def test_the_model_takes_no_parallel_arguments():
    assert list(inspect.signature(CausalLM.__init__).parameters) == ["self", "cfg",
                                                                     "padded_vocab"]


def test_a_stage_keeps_its_layers_and_the_tied_table_copy():
    cfg = _model_cfg()
    with torch.device("meta"):
        middle, last = (arch_class("gpt")(cfg.model, cfg.padded_vocab_size) for _ in range(2))
    parallelize(middle, Parallelism(stage=(1, 3)))
    parallelize(last, Parallelism(stage=(2, 4)))
    assert list(middle.layers.keys()) == ["1", "2"] and middle.layer_range == (1, 3)
    assert middle.embed is None and middle.norm is None and middle.head is None
    assert not middle.is_first and not middle.is_last
    assert isinstance(last.embed, TiedEmbedding) and last.is_last and last.norm is not None
    materialize(last, "cpu")
    w = last.embed.wte.weight
    assert w.device.type == "cpu" and w.shared_copy and w.tp_degree == 1 and w.tp_spec is not None
    for name, p in last.named_parameters():
        assert p.init_rule is not None and p.tp_degree == 1, name


def test_build_on_meta_gives_the_model_built_on_the_host():
    """Weights (seeded per name and slice) and the rotary tables (made on the host and
    moved) are those of a model built directly on the CPU."""
    cfg = _model_cfg("llama-tiny")
    built = build(Llama, cfg.model, cfg.padded_vocab_size, Parallelism(recompute="full"), seed=5)
    direct = Llama(cfg.model, cfg.padded_vocab_size)  # built on the CPU, not parallelised
    init_parameters(direct, 5, 0, 1)
    assert built.recompute == "full"
    for (n, a), (m, b) in zip(built.named_parameters(), direct.named_parameters()):
        assert n == m and torch.equal(a, b), n
    rot_a, rot_b = built.layers[0].attn.rotary, direct.layers[0].attn.rotary
    assert rot_a is built.layers[1].attn.rotary  # one table for every layer
    assert torch.equal(rot_a.cos, rot_b.cos) and torch.equal(rot_a.sin, rot_b.sin)
