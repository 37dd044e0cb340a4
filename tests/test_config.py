"""Config loading, overrides and validation (no torch.distributed needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from oases.config import Config, load_config, save_config
from oases.errors import ConfigError, UserError

YAML = """\
out_dir: runs/test
seed: 7
model:
  name: llama-tiny
  n_layer: 2
  dropout: 0.1
parallel:
  tp: 2
  recompute: full
train:
  steps: 5
  lr: 1e-3          # YAML 1.1 reads this as the string "1e-3"
  min_lr: 0
  micro_batch_size: 4
  grad_accum: 2
wandb:
  mode: disabled
"""


@pytest.fixture
def yaml_file(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(YAML)
    return p


def test_yaml_then_overrides(yaml_file):
    cfg = load_config(str(yaml_file), ["train.steps=50", "model.d_model=64", "seed=3",
                                       "parallel.recompute=none", "wandb.name=001"])
    assert cfg.out_dir == "runs/test"
    assert cfg.seed == 3                      # override beats the file
    assert cfg.train.steps == 50 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.train.min_lr == 0.0 and isinstance(cfg.train.min_lr, float)
    assert cfg.model.name == "llama-tiny" and cfg.model.n_layer == 2
    assert cfg.model.d_model == 64 and cfg.model.dropout == 0.1
    assert cfg.parallel.recompute == "none" and cfg.parallel.tp == 2
    assert cfg.wandb.name == "001"            # strings are kept verbatim, not parsed as 1
    assert cfg.train.beta2 == 0.95            # untouched defaults survive
    # unresolved until validate(): fields not given stay None
    assert cfg.model.n_head is None

    cfg.validate(world_size=4)
    assert cfg.model.arch == "llama"
    assert (cfg.model.n_head, cfg.model.n_kv_heads, cfg.model.ffn_hidden) == (4, 2, 384)
    assert cfg.model.n_layer == 2 and cfg.model.d_model == 64   # explicit values win
    assert cfg.model.head_dim == 16
    assert cfg.dp == 2
    assert cfg.global_batch_size == 4 * 2 * 2
    assert cfg.padded_vocab_size == 256


def test_no_file_defaults():
    cfg = load_config(None, [])
    assert cfg == Config()
    cfg.validate()
    assert cfg.model.arch == "gpt" and cfg.model.vocab_size == 256 and cfg.dp == 1


@pytest.mark.parametrize("raw,value", [("1e-3", 1e-3), ("0.002", 0.002), ("2", 2.0),
                                       ("3E-4", 3e-4), (".5", 0.5)])
def test_float_override_forms(raw, value):
    cfg = load_config(None, [f"train.lr={raw}"])
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == pytest.approx(value)


def test_bool_and_optional_overrides():
    cfg = load_config(None, ["model.tie_embeddings=false", "model.vocab_size=250",
                             "debug=true"])
    assert cfg.model.tie_embeddings is False and cfg.debug is True
    cfg.validate()
    assert cfg.model.tie_embeddings is False          # not overwritten by the named size
    assert cfg.model.vocab_size == 250 and cfg.padded_vocab_size == 256


@pytest.mark.parametrize("override,bad,suggest", [
    ("train.stpes=3", "train.stpes", "train.steps"),
    ("trian.steps=3", "trian", "train"),
    ("sed=1", "sed", "seed"),
    ("model.n_layers=2", "model.n_layers", "model.n_layer"),
    ("parallel.recomput=full", "parallel.recomput", "parallel.recompute"),
])
def test_unknown_override_key_suggests(override, bad, suggest):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert repr(bad) in msg, msg
    assert f"did you mean {suggest}?" in msg, msg


def test_unknown_key_without_near_miss():
    with pytest.raises(ConfigError, match="unknown config key 'train.zzzzzz'") as e:
        load_config(None, ["train.zzzzzz=1"])
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize("text,bad,suggest", [
    ("train:\n  stpes: 3\n", "train.stpes", "train.steps"),
    ("modle:\n  name: gpt-tiny\n", "modle", "model"),
    ("model:\n  d_modle: 64\n", "model.d_modle", "model.d_model"),
])
def test_unknown_yaml_key_suggests(tmp_path, text, bad, suggest):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert repr(bad) in str(e.value) and f"did you mean {suggest}?" in str(e.value)


@pytest.mark.parametrize("override,key,expected", [
    ("train.steps=abc", "train.steps", "int"),
    ("train.lr=fast", "train.lr", "float"),
    ("train.steps=1.5", "train.steps", "int"),
    ("train.steps=true", "train.steps", "int"),       # a bool is not an int
    ("model.n_layer=two", "model.n_layer", "int"),
    ("model.tie_embeddings=maybe", "model.tie_embeddings", "bool"),
    ("debug=1", "debug", "bool"),
])
def test_wrong_type_override(override, key, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert key in msg and "wrong type" in msg and f"expected {expected}" in msg, msg


def test_wrong_type_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: abc\n")
    with pytest.raises(ConfigError, match=r"train\.steps='abc' has the wrong type"):
        load_config(str(p))
    p.write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train must be a mapping"):
        load_config(str(p))


def test_malformed_inputs(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.steps"])
    with pytest.raises(ConfigError, match="sets a whole section"):
        load_config(None, ["train=3"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["seed.x=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(str(bad))
    assert issubclass(ConfigError, UserError)


@pytest.mark.parametrize("overrides,world,needles", [
    (["parallel.tp=3"], 4, ["parallel.tp=3", "world size 4"]),
    (["parallel.tp=8"], 8, ["parallel.tp=8", "model.n_head=4"]),
    (["model.name=llama-tiny", "model.d_model=96", "model.n_head=12", "model.n_kv_heads=3",
      "parallel.tp=4"], 4, ["parallel.tp=4 neither divides", "model.n_kv_heads=3"]),
    (["model.ffn_hidden=510", "parallel.tp=4"], 4, ["parallel.tp=4", "model.ffn_hidden=510"]),
    (["model.d_model=130"], 1, ["model.d_model=130", "model.n_head=4"]),
    (["model.n_kv_heads=3", "model.name=llama-tiny"], 1, ["model.n_head=4",
                                                          "model.n_kv_heads=3"]),
])
def test_tp_and_shape_divisibility(overrides, world, needles):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world_size=world)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_valid_tp_accepted():
    cfg = load_config(None, ["parallel.tp=4"]).validate(world_size=8)
    assert cfg.dp == 2
    cfg = load_config(None, ["model.name=llama-tiny", "parallel.tp=2"]).validate(world_size=2)
    assert cfg.dp == 1


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.recompute=partial"], "parallel.recompute='partial'"),
    (["train.precision=fp16"], "train.precision='fp16'"),
    (["model.dropout=1.0"], "model.dropout=1.0"),
    (["train.steps=0"], "train.steps=0"),
    (["train.lr=1e-4", "train.min_lr=1e-3"], "train.min_lr"),
    (["data.kind=tokens"], "data.train_path"),
    (["model.name=gpt-tiny", "model.n_kv_heads=2"], "arch=gpt"),
])
def test_impossible_values(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides).validate()
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parent.parent / "configs")
                                         .glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path, tmp_path):
    overrides = []
    if path.stem.startswith("sft-"):  # it fine-tunes the HF directory docs/sft.md makes first
        from oases.cli.tiny_hf import make_tiny_llama
        overrides = [f"model.init_from=hf:{make_tiny_llama(tmp_path / 'hf')}"]
    cfg = load_config(str(path), overrides).validate(world_size=2)
    if not overrides:  # gpt-tiny.yaml -> gpt-tiny, gpt.yaml -> gpt-350m
        assert cfg.model.name.startswith(path.stem)
    assert cfg.model.arch in ("gpt", "llama") and cfg.dp * cfg.parallel.tp == 2


@pytest.mark.parametrize("name,near", [("gpt-tinny", "gpt-tiny"), ("llama-tiyn", "llama-tiny"),
                                       ("gpt-125M", "gpt-125m")])
def test_unknown_model_name_suggests(name, near):
    cfg = load_config(None, [f"model.name={name}"])
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    msg = str(e.value)
    assert f"model.name={name!r}" in msg and f"did you mean {near!r}?" in msg, msg


def test_save_config_round_trip(tmp_path, yaml_file):
    cfg = load_config(str(yaml_file), ["train.lr=3e-4", "wandb.name=007",
                                       "model.tie_embeddings=true"]).validate(world_size=2)
    out = tmp_path / "saved.yaml"
    save_config(cfg, out)
    assert not (tmp_path / "saved.yaml.tmp").exists()       # written atomically
    assert yaml.safe_load(out.read_text())["train"]["lr"] == 3e-4
    back = load_config(str(out))
    assert back.to_dict() == cfg.to_dict()
    assert back == cfg
    assert back.wandb.name == "007" and isinstance(back.train.lr, float)
    back.validate(world_size=2)
    assert dataclasses.asdict(back) == cfg.to_dict()

    # a saved default config round-trips too (unresolved None fields included)
    plain = load_config(None, [])
    save_config(plain, out)
    assert load_config(str(out)) == plain


@pytest.mark.parametrize("override", ["train.lr=nan", "train.grad_clip=nan",
                                      "train.weight_decay=nan", "train.min_lr=nan",
                                      "model.init_std=-0.02", "model.init_std=nan",
                                      "parallel.timeout_s=nan", "parallel.timeout_s=inf",
                                      "parallel.timeout_s=1e10"])
def test_nan_and_negative_values_refused(override):
    # NaN passes `value < 0 or value == 0` (every comparison with NaN is False), so
    # positive() must reject it explicitly; a NaN learning rate silently ruins a run.
    # model.init_std is not checked at all: a negative one fails later, inside
    # torch.normal_, with a RuntimeError instead of a ConfigError naming the key.
    cfg = load_config(None, [override])
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        cfg.validate()


def test_frozen_config_refuses_writes_and_derives_copies():
    """A run freezes its validated config: a write anywhere in it is a bug that fails
    where it happens; ``with_changes`` derives a validated copy and leaves it as it is."""
    import dataclasses

    cfg = load_config("configs/gpt-tiny.yaml").validate(4).freeze()
    for section, key in ((cfg.train, "lr"), (cfg.parallel, "tp"), (cfg, "seed")):
        with pytest.raises(dataclasses.FrozenInstanceError, match="frozen after validation"):
            setattr(section, key, 1)
    new = cfg.with_changes({"parallel.tp": 1, "train.grad_accum": 3})
    assert (new.parallel.tp, new.train.grad_accum, new.dp, new.frozen) == (1, 3, 4, True)
    assert (cfg.parallel.tp, cfg.train.grad_accum, cfg.dp) == (2, 1, 2)
    with pytest.raises(ConfigError, match="parallel.tp=3 does not divide"):
        cfg.with_changes({"parallel.tp": 3})
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'"):
        cfg.with_changes({"train.lrr": 1.0})
    thawed = load_config("configs/gpt-tiny.yaml").validate(2)
    thawed.train.lr = 1e-3  # not frozen before a run freezes it
    assert not thawed.frozen
