"""Data blends (``data.train_paths``): proportions, determinism, resume, DP sharding,
bad input, and the single-file order left as it was.

Each file is written as ``oases.prepare`` writes it (``train.bin`` and a ``meta.json``
with the dtype, token count and largest id, one directory per file). File ``k``'s
token ids are ``k * BASE + arange``, so a sample's first token names its file and its
window.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from oases.cli.config import main as config_main
from oases.config import DataConfig, load_config
from oases.errors import CheckpointError, ConfigError
from oases.runtime import data as D
from oases.runtime.blend import Blend

# A training run imports torch._inductor (~2 s of CPU); imported here once, the forked
# workers of the trainer test inherit it.
import torch._inductor.config  # noqa: E402,F401  isort: skip

T = 8
BASE = 10_000  # file k's ids are k*BASE + position: a window knows its file
VOCAB = 8 * BASE


def prepared(root: Path, name: str, n_windows: int, file_index: int,
             dtype: str = "uint16") -> Path:
    """``root/name/train.bin`` of ``n_windows`` windows and its meta.json, as
    ``oases.prepare`` writes them."""
    d = root / name
    d.mkdir(parents=True)
    ids = (file_index * BASE + np.arange(n_windows * T + 1)).astype(np.dtype(dtype))
    ids.tofile(d / "train.bin")
    meta = {"vocab_size": VOCAB, "dtype": dtype, "tokenizer": "test",
            "train_tokens": len(ids), "train_max_id": int(ids.max())}
    (d / "meta.json").write_text(json.dumps(meta))
    return d / "train.bin"


def blend_cfg(entries) -> DataConfig:
    return DataConfig(kind="tokens", train_paths=[{"path": str(p), "weight": w}
                                                  for p, w in entries])


def make(cfg: DataConfig, mbs: int = 4, dp_rank: int = 0, dp: int = 1,
         seed: int = 7) -> D.TrainBatches:
    return D.TrainBatches(cfg, seq_len=T, vocab_size=VOCAB, micro_batch_size=mbs,
                          dp_rank=dp_rank, dp=dp, seed=seed)


def samples(x: torch.Tensor) -> list[tuple[int, int]]:
    """(file, window) of each row."""
    return [(int(v) // BASE, (int(v) % BASE) // T) for v in x[:, 0]]


def draw(tb: D.TrainBatches, batches: int) -> list[tuple[int, int]]:
    return [s for _ in range(batches) for s in samples(tb.next_batch()[0])]


@pytest.fixture
def three(tmp_path) -> list[tuple[Path, float]]:
    """A large, a medium and a small file (3 windows: it wraps every few batches)."""
    return [(prepared(tmp_path, "big", 400, 0), 0.5),
            (prepared(tmp_path, "mid", 40, 1), 0.3),
            (prepared(tmp_path, "small", 3, 2), 0.2)]


def max_prefix_error(files: list[int], weights: list[float]) -> float:
    """The largest |count_k(n) - w_k n| over every prefix n and file k."""
    counts = np.zeros(len(weights))
    worst = 0.0
    for n, k in enumerate(files, start=1):
        counts[k] += 1
        worst = max(worst, float(np.abs(counts - np.asarray(weights) * n).max()))
    return worst


# ---------------------------------------------------------------------------
# proportions


def test_proportions_track_the_weights_within_one_sample(three):
    tb = make(blend_cfg(three), mbs=5)
    got = draw(tb, 120)                                  # 600 samples
    assert max_prefix_error([f for f, _ in got], [0.5, 0.3, 0.2]) < 1
    assert [sum(f == k for f, _ in got) for k in range(3)] == [300, 180, 120]
    assert tb.state_dict()["blend"][2]["consumed"] == 120
    # each file walks its own epochs: every window once per epoch of that file
    small = [w for f, w in got if f == 2]
    for e in range(40):
        assert sorted(small[3 * e:3 * e + 3]) == [0, 1, 2]
    mid = [w for f, w in got if f == 1]
    assert sorted(mid[:40]) == sorted(mid[40:80]) == list(range(40)) and mid[:40] != mid[40:80]
    assert tb.file_epochs == [300 / 400, 180 / 40, 120 / 3]
    assert tb.epoch == 600 / 443 and tb.num_windows == 443


@pytest.mark.parametrize("raw", [[2, 2, 93, 2, 93], [1, 1, 98], [1, 1, 1, 97]])
def test_schedule_error_below_one_sample_where_the_plain_greedy_exceeds_it(raw):
    """Megatron's rule (largest w_k*g - c_k) lets these blends lag by more than one
    sample (1.36, 1.30, 1.47); the schedule stays within 1 - 1/(2K-2)."""
    weights = [w / sum(raw) for w in raw]
    files, _ = Blend([str(i) for i in range(len(raw))], raw).take(400)
    bound = 1 - 1 / (2 * len(raw) - 2)
    assert max_prefix_error(files.tolist(), weights) <= bound + 1e-9


def test_schedule_bound_on_random_weights():
    rng = np.random.default_rng(0)
    for k in range(2, 9):
        for _ in range(6):
            w = (rng.random(k) ** 3 + 1e-3).tolist()
            files, local = Blend([str(i) for i in range(k)], w).take(300)
            norm = [v / sum(w) for v in w]
            assert max_prefix_error(files.tolist(), norm) <= 1 - 1 / (2 * k - 2) + 1e-9
            for j in range(k):                           # local = the file's running count
                assert local[files == j].tolist() == list(range(int((files == j).sum())))


# ---------------------------------------------------------------------------
# determinism, DP, resume


def test_same_seed_same_order_other_seed_other_order(three):
    a, b = draw(make(blend_cfg(three)), 30), draw(make(blend_cfg(three)), 30)
    c = draw(make(blend_cfg(three), seed=8), 30)
    assert a == b
    assert [f for f, _ in a] == [f for f, _ in c]        # the file sequence is the weights'
    assert a != c                                        # the windows are the seed's


def test_dp_ranks_take_disjoint_slices_of_the_global_order(three):
    one = make(blend_cfg(three), mbs=4)
    two = [make(blend_cfg(three), mbs=2, dp_rank=r, dp=2) for r in range(2)]
    for _ in range(40):                                  # the small file wraps many times
        x, y = one.next_batch()
        parts = [t.next_batch() for t in two]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
        assert torch.equal(y[:, :-1], x[:, 1:])
    assert two[0].state_dict() == two[1].state_dict() == one.state_dict()


@pytest.mark.parametrize("dp_before,dp_after", [(1, 1), (2, 2), (2, 1)])
def test_resume_mid_epoch_across_files(three, dp_before, dp_after):
    ref = make(blend_cfg(three), mbs=4)
    expected = [ref.next_batch() for _ in range(25)]     # global batches of 4
    mbs = 4 // dp_before
    ranks = [make(blend_cfg(three), mbs=mbs, dp_rank=r, dp=dp_before) for r in range(dp_before)]
    for _ in range(9):
        for t in ranks:
            t.next_batch()
    state = json.loads(json.dumps(ranks[0].state_dict()))  # as the checkpoint's meta.json
    epochs = ranks[0].file_epochs
    assert epochs[2] > 2 and epochs[2] != int(epochs[2])  # the small file wrapped, mid-epoch
    assert 0 < epochs[1] < 1 and 0 < epochs[0] < 1       # the others are in their first
    paths = sum(len(json.dumps(b["path"])) for b in state["blend"])
    assert len(json.dumps(state)) - paths < 250          # counters, not index arrays
    mbs = 4 // dp_after
    resumed = [make(blend_cfg(three), mbs=mbs, dp_rank=r, dp=dp_after) for r in range(dp_after)]
    for t in resumed:
        t.load_state_dict(state)
    for x, y in expected[9:]:
        parts = [t.next_batch() for t in resumed]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_resume_with_another_blend_is_refused(three, tmp_path):
    tb = make(blend_cfg(three))
    draw(tb, 5)
    state = json.loads(json.dumps(tb.state_dict()))
    reweighted = [(p, w) for p, w in three[:2]] + [(three[2][0], 0.4)]
    other = prepared(tmp_path, "other", 40, 3)
    cases = {
        "weights": (blend_cfg(reweighted), "weight 0.4"),
        "paths": (blend_cfg([three[0], (other, 0.3), three[2]]), str(other)),
        "fewer files": (blend_cfg(three[:2]), "data.train_paths is"),
        "one file": (DataConfig(kind="tokens", train_path=str(three[0][0])),
                     "this run reads data.train_path="),
        "synthetic": (DataConfig(), "this run reads synthetic data"),
    }
    for what, (cfg, needle) in cases.items():
        fresh = make(cfg)
        with pytest.raises(CheckpointError, match="blend") as e:
            fresh.load_state_dict(state)
        assert needle in str(e.value) and "\n" not in str(e.value), what
        assert fresh.consumed == 0, what                 # nothing half-loaded
    with pytest.raises(CheckpointError, match="not in a blend"):
        make(blend_cfg(three)).load_state_dict({"consumed": 20})
    bad_counts = dict(state, consumed=state["consumed"] + 4)
    with pytest.raises(CheckpointError, match="add up to 20, not its consumed count 24"):
        make(blend_cfg(three)).load_state_dict(bad_counts)
    with pytest.raises(CheckpointError, match="malformed blend"):
        make(blend_cfg(three)).load_state_dict({"consumed": 20, "blend": [{"path": 3}]})
    # the same blend, weights written another way (3:5:2 vs 0.3/0.5/0.2), resumes
    same = make(blend_cfg([(three[0][0], 5), (three[1][0], 3), (three[2][0], 2)]))
    same.load_state_dict(state)
    assert same.state_dict()["blend"] == [dict(e, weight=pytest.approx(e["weight"]))
                                          for e in state["blend"]]


# ---------------------------------------------------------------------------
# the single file: unchanged


def test_single_train_path_order_is_unchanged(tmp_path):
    """The windows drawn from one ``data.train_path`` are those of the sampler before
    blends (recorded from it: seed 7, 24 windows, mbs 3; and seed -5, dp rank 1 of 2)."""
    path = tmp_path / "train.bin"
    np.arange(24 * T + 1, dtype="<u2").tofile(path)
    cfg = DataConfig(kind="tokens", train_path=str(path))
    tb = D.TrainBatches(cfg, T, 1000, 3, 0, 1, 7)
    got = [w for _ in range(20) for w in (tb.next_batch()[0][:, 0] // T).tolist()]
    assert got == [1, 7, 20, 6, 16, 15, 9, 4, 2, 5, 12, 22, 3, 18, 8, 19, 21, 13, 10, 0, 17,
                   23, 11, 14, 17, 15, 6, 19, 23, 18, 1, 13, 9, 22, 7, 21, 0, 20, 8, 3, 5, 16,
                   4, 10, 11, 14, 2, 12, 23, 13, 12, 3, 15, 8, 0, 7, 10, 16, 6, 4]
    assert tb.state_dict() == {"consumed": 60}           # the checkpoint format too
    tb = D.TrainBatches(cfg, T, 1000, 2, 1, 2, -5)
    got = [w for _ in range(20) for w in (tb.next_batch()[0][:, 0] // T).tolist()]
    assert got == [14, 9, 10, 20, 16, 19, 12, 13, 8, 23, 1, 7, 13, 23, 19, 21, 11, 1, 14, 0,
                   20, 17, 16, 8, 7, 2, 16, 0, 4, 1, 14, 8, 20, 18, 9, 10, 12, 18, 14, 10]


# ---------------------------------------------------------------------------
# bad input: one line naming the problem


@pytest.mark.parametrize("case,needle", [
    ("both", "data.train_path and data.train_paths are both set"),
    ("empty", "data.train_paths is empty"),
    ("not_list", "data.train_paths must be a list of {path: FILE, weight: W}"),
    ("zero", "data.train_paths[1].weight=0 must be a finite number > 0"),
    ("negative", "data.train_paths[0].weight=-0.5 must be a finite number > 0"),
    ("nan", "data.train_paths[2].weight='nan' must be a finite number > 0"),
    ("text", "data.train_paths[1].weight='lots' is not a number"),
    ("bool", "data.train_paths[1].weight=True is not a number"),
    ("no_weight", "data.train_paths[2] needs a weight"),
    ("typo", "data.train_paths[0] has unknown key 'wieght'"),
    ("pair", "data.train_paths[1] must be a mapping {path: FILE, weight: W}"),
    ("missing", "data.train_paths[1].path="),
    ("twice", "data.train_paths[0] and [2] are both"),
])
def test_bad_blend_config(three, tmp_path, case, needle):
    e = [{"path": str(p), "weight": w} for p, w in three]
    cfg = DataConfig(kind="tokens", train_paths=e)
    if case == "both":
        cfg.train_path = str(three[0][0])
    elif case == "empty":
        cfg.train_paths = []
    elif case == "not_list":
        cfg.train_paths = str(three[0][0])
    elif case == "zero":
        e[1]["weight"] = 0
    elif case == "negative":
        e[0]["weight"] = -0.5
    elif case == "nan":
        e[2]["weight"] = "nan"
    elif case == "text":
        e[1]["weight"] = "lots"
    elif case == "bool":
        e[1]["weight"] = True
    elif case == "no_weight":
        del e[2]["weight"]
    elif case == "typo":
        e[0]["wieght"] = e[0].pop("weight")
    elif case == "pair":
        e[1] = [0.3, e[1]["path"]]
    elif case == "missing":
        e[1]["path"] = str(tmp_path / "nope" / "train.bin")
        needle += f"{tmp_path / 'nope' / 'train.bin'} does not exist"
    elif case == "twice":
        e[2]["path"] = str(Path(e[0]["path"]).parent / ".." / "big" / "train.bin")
    for run in (cfg.validate, lambda: make(cfg)):        # the config check and the sampler
        with pytest.raises(ConfigError) as err:
            run()
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_files_that_disagree_on_dtype(tmp_path):
    a = prepared(tmp_path, "a", 20, 0)
    b = prepared(tmp_path, "b", 20, 1, dtype="uint32")
    cfg = blend_cfg([(a, 1), (b, 1)])
    cfg.validate()                                       # the config alone cannot know
    with pytest.raises(ConfigError, match=r"mixes token dtypes: .*a/train.bin is uint16 but "
                                          r".*b/train.bin is uint32 \(per their meta.json\)"):
        make(cfg)


def test_weights_are_normalised_and_a_yaml_1e_3_weight_reads(three):
    cfg = DataConfig(kind="tokens", train_paths=[{"path": str(three[0][0]), "weight": 3},
                                                 {"path": str(three[1][0]), "weight": "1e-3"}])
    pairs = cfg.blend()
    assert [w for _, w in pairs] == [3 / 3.001, 0.001 / 3.001]
    assert math.fsum(w for _, w in pairs) == 1.0


# ---------------------------------------------------------------------------
# the config: YAML, overrides, saved config


def test_yaml_and_override_forms(three, tmp_path):
    body = {"data": {"kind": "tokens", "dtype": "uint16",
                     "train_paths": [{"path": str(p), "weight": w} for p, w in three]},
            "model": {"vocab_size": VOCAB}}
    path = tmp_path / "blend.yaml"
    path.write_text(yaml.safe_dump(body))
    cfg = load_config(str(path)).validate()
    assert [w for _, w in cfg.data.blend()] == [0.5, 0.3, 0.2]
    flow = "[" + ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in three[:2]) + "]"
    cfg = load_config(str(path), [f"data.train_paths={flow}"]).validate()
    assert [p for p, _ in cfg.data.blend()] == [str(p) for p, _ in three[:2]]
    # switching a blend config to one file: null clears train_paths
    one = load_config(str(path), ["data.train_paths=null",
                                  f"data.train_path={three[0][0]}"]).validate()
    assert one.data.train_paths is None
    # the config.yaml a run saves loads back to the same blend
    from oases.config import save_config
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(str(tmp_path / "saved.yaml")).validate().data.blend() == cfg.data.blend()
    # python -m oases.config: 0 for the blend, 2 and one line for a bad weight
    assert config_main(["--config", str(path)]) == 0
    bad = flow.replace("weight: 0.5", "weight: 0")
    assert config_main(["--config", str(path), f"data.train_paths={bad}"]) == 2


# ---------------------------------------------------------------------------
# through the trainer: the blend's state in a real checkpoint


GPT_TINY = str(Path(__file__).resolve().parents[1] / "configs" / "gpt-tiny.yaml")


def test_trainer_checkpoints_and_resumes_the_blend(tmp_path):
    """train.py's path (config overrides, TrainBatches, checkpoint meta.json, resume=auto):
    the blend's counts are saved, a resume continues them, another blend is refused."""
    from tests.support.distributed import run_distributed
    from tests.support.loop import train_worker

    rng = np.random.default_rng(0)
    files = []
    for name, n in (("a", 3000), ("b", 700)):
        d = tmp_path / name
        d.mkdir()
        ids = rng.integers(0, 256, n).astype("<u2")
        ids.tofile(d / "train.bin")
        (d / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16",
                                                 "train_tokens": n,
                                                 "train_max_id": int(ids.max())}))
        files.append(d / "train.bin")
    out = tmp_path / "run"

    def args(steps, wb=0.25):
        blend = f"[{{path: {files[0]}, weight: 0.75}}, {{path: {files[1]}, weight: {wb}}}]"
        return [f"out_dir={out}", "parallel.tp=1", f"train.steps={steps}",
                "train.micro_batch_size=2", "model.seq_len=32", "eval.interval=0",
                "wandb.mode=disabled", "data.train_path=", f"data.train_paths={blend}",
                "data.val_path=", "resume=auto", "checkpoint.interval=2"]

    def data_state(step):
        meta = json.loads((out / "checkpoints" / f"step_{step:06d}" / "meta.json").read_text())
        return meta["data"]

    run_distributed(train_worker, world=1, tp=None, args=(args(2), GPT_TINY))
    state = data_state(2)
    assert state["consumed"] == 4 and [e["consumed"] for e in state["blend"]] == [3, 1]
    assert [e["path"] for e in state["blend"]] == [str(f.resolve()) for f in files]
    run_distributed(train_worker, world=1, tp=None, args=(args(4), GPT_TINY))  # resumes from step 2
    assert [e["consumed"] for e in data_state(4)["blend"]] == [6, 2]
    with pytest.raises(AssertionError, match=r"CheckpointError: the checkpoint's data blend is "
                                             r".*but data.train_paths is .*weight 0\.4"):
        run_distributed(train_worker, world=1, tp=None, args=(args(6, wb=0.5), GPT_TINY))
