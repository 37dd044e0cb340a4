"""``oases generate --chat`` and the chat template of an export.

The prompt ids of a conversation are ``transformers``' ``apply_chat_template(...,
add_generation_prompt=True)`` ids, for Llama 3's template and a Qwen2-style one; the end
of a turn is found from the template (``<|eot_id|>``, ``<|im_end|>``, ``eos_token``,
none); and on a checkpoint trained from the tiny HF directory of
``python -m oases.cli.tiny_hf``, ``oases generate --chat`` gives token for token what
``apply_chat_template`` + ``generate(do_sample=False)`` gives on its export. The tiny
model's weight matrices are redrawn with std 0.2 (at HF's init a tiny model repeats one
token, which would hide a wrong position or prompt).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from oases.cli import tokenizer as toks  # noqa: E402
from oases.cli.chat import Chat  # noqa: E402
from oases.cli.export import main as export_main  # noqa: E402
from oases.cli.generate import main as generate_main  # noqa: E402
from oases.cli.tiny_hf import byte_tokenizer, make_tiny_llama  # noqa: E402
from oases.config import load_config  # noqa: E402
from oases.runtime import trainer  # noqa: E402
from tests.support.single_world import world_of_one  # noqa: E402

QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Llama 2 / Mistral style: a reply is closed by eos_token; and one closed by plain text
EOS_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
                " [/INST]{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
TEXT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 plus 3?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Spell cat."}],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny chat Llama, its weight matrices redrawn (module docstring)."""
    out = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama-chat")
    model = AutoModelForCausalLM.from_pretrained(out)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out


def _qwen_dir(root: Path, template: str = QWEN2_TEMPLATE) -> Path:
    """A byte-level tokenizer with Qwen2's special tokens (no BOS) and ``template``."""
    from transformers import PreTrainedTokenizerFast
    out = root / "qwen"
    PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(QWEN2_SPECIALS, bos=None),
                            eos_token="<|endoftext|>", chat_template=template).save_pretrained(out)
    return out


def test_prompt_ids_are_apply_chat_templates(tiny, tmp_path):
    qwen = _qwen_dir(tmp_path)
    for d in (tiny, qwen):
        chat, hf = Chat.of(toks.from_hf_dir(d)), AutoTokenizer.from_pretrained(d)
        for conv in CONVERSATIONS:
            want = hf.apply_chat_template(conv, add_generation_prompt=True)["input_ids"]
            assert chat.prompt_ids(conv) == want
    # Llama 3: one BOS, from the template; the prompt ends with the assistant's header
    ids = Chat.of(toks.from_hf_dir(tiny)).prompt_ids(CONVERSATIONS[0])
    assert ids[0] == 256 and ids.count(256) == 1
    assert ids[-len("assistant") - 4:] == [258, *b"assistant", 259, 10, 10]


def test_end_of_turn_comes_from_the_template(tiny, tmp_path):
    # the tiny directory lists <|eot_id|> among its EOS ids; without it, the template
    # still gives it
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [257, 260]
    bare = shutil.copytree(tiny, tmp_path / "bare")
    (bare / "generation_config.json").write_text(json.dumps({"eos_token_id": 257}))
    (bare / "config.json").write_text(json.dumps({"eos_token_id": 257}))
    chat = Chat.of(toks.from_hf_dir(bare))
    assert chat.tok.eos_ids == [257] and chat.end_of_turn_ids() == [260]
    assert chat.stop_ids == [257, 260]
    t = toks.from_hf_dir(_qwen_dir(tmp_path))
    assert Chat.of(t).end_of_turn_ids() == [t.tok.token_to_id("<|im_end|>")] == [258]
    for template, want in [(EOS_TEMPLATE, [t.eos_id]), (TEXT_TEMPLATE, [])]:
        f = tmp_path / "t.jinja"
        f.write_text(template)
        assert Chat.of(t, str(f)).end_of_turn_ids() == want, template
    assert t.eos_id == 256
    # eos_token is the one the directory's tokenizer_config.json declares (<|eot_id|>),
    # not the first EOS id (<|end_of_text|>), as AutoTokenizer of the directory has it
    f.write_text(EOS_TEMPLATE)
    chat = Chat.of(toks.from_hf_dir(tiny), str(f))
    assert chat.tok.eos_id == 257 and chat.end_of_turn_ids() == [260]
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    want = AutoTokenizer.from_pretrained(tiny).apply_chat_template(
        conv, chat_template=EOS_TEMPLATE)["input_ids"]
    assert chat.prompt_ids(conv) == want and want[-1] == 260


def test_generate_chat_matches_transformers_on_the_export(tiny, tmp_path, capsys):
    """One training step from the tiny directory (synthetic tokens, so the run records no
    tokenizer: ``--tokenizer`` names it), then generate --chat on the checkpoint and
    transformers on its export."""
    run, out = tmp_path / "run", tmp_path / "hf"
    cfg = load_config(None, [
        f"model.init_from=hf:{tiny}", "model.seq_len=128", "data.kind=synthetic",
        "train.steps=1", "train.micro_batch_size=1", "eval.interval=0",
        "wandb.mode=disabled", f"out_dir={run}"]).validate(1).freeze()
    with world_of_one(tmp_path) as ctx:
        trainer.check_out_dir(cfg)
        trainer.train(cfg, ctx)
    # the start-up line names the model it trains: the HF directory's, not model.name's
    assert f"oases: hf:{tiny} (llama, " in capsys.readouterr().out
    convs = tmp_path / "convs.jsonl"
    convs.write_text(json.dumps({"messages": CONVERSATIONS[1] + [
        {"role": "assistant", "content": "tac"}]}) + "\n" + json.dumps({"prompt": "Hi"}) + "\n")
    capsys.readouterr()
    assert generate_main([str(run), "--tokenizer", str(tiny), "--chat", "--prompt",
                          CONVERSATIONS[0][0]["content"], "--conversations", str(convs),
                          "--max-new-tokens", "12", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    rows = rec["outputs"]
    assert rec["chat"] and [r["messages"] for r in rows] == [
        CONVERSATIONS[0], CONVERSATIONS[1], [{"role": "user", "content": "Hi"}]]
    assert rows[1]["reference"] == "tac" and "reference" not in rows[0]
    assert export_main([str(run), "--to-hf", str(out), "--tokenizer", str(tiny)]) == 0
    capsys.readouterr()
    assert (out / "chat_template.jinja").read_text() == (tiny / "chat_template.jinja").read_text()
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == \
        (tiny / "chat_template.jinja").read_text()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [257, 260]
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    for row in rows:
        enc = tok.apply_chat_template(row["messages"], add_generation_prompt=True,
                                      return_tensors="pt")
        assert enc["input_ids"][0].tolist() == row["prompt_ids"]
        hf = model.generate(**enc, do_sample=False, max_new_tokens=12)[0]
        new = hf[enc["input_ids"].shape[1]:].tolist()
        assert new == row["ids"], (new, row["ids"])
        assert row["finished"] == (new[-1] in (257, 260)) and (row["finished"] or len(new) == 12)
        assert tok.decode(new, skip_special_tokens=True) == row["text"]
    assert [r["finished"] for r in rows] == [True, False, False]  # row 0 ends at an EOS id
    # the printed form: the replies alone
    assert generate_main([str(run), "--tokenizer", str(tiny), "--chat", "--prompt",
                          CONVERSATIONS[0][0]["content"], "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == rows[0]["text"] + "\n"


def test_bad_chat_input_is_one_line_exit_2(tiny, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    no_template = tmp_path / "plain"
    shutil.copytree(tiny, no_template)
    (no_template / "chat_template.jinja").unlink()
    (tmp_path / "raise.jinja").write_text("{{ raise_exception('only user turns') }}")
    cases = [
        (["--chat", "--ids", "1,2"], None, "not --ids"),
        (["--conversations", str(bad), "--prompt", "x"], None, "need --chat"),
        (["--chat"], None, "--chat needs --prompt TEXT or --conversations FILE"),
        (["--chat", "--conversations", str(bad)],
         '{"messages": [{"role": "user", "content": "a"}]}\n'
         '{"messages": [{"role": "robot", "content": "a"}]}\n',
         f"{bad}:2: messages[0] has the role 'robot'"),
        (["--chat", "--conversations", str(bad)],
         '{"messages": [{"role": "user", "content": ["a"]}]}\n',
         f"{bad}:1: messages[0] (user) has a list content, not text"),
        (["--chat", "--conversations", str(bad)], "{nope\n", f"{bad}:1: not a JSON object"),
        (["--chat", "--prompt", "x", "--chat-template", str(tmp_path / "raise.jinja")], None,
         "the chat template failed on a conversation of 2 messages (user, assistant): "
         "TemplateError: only user turns"),
        (["--chat", "--prompt", "x", "--chat-template", str(tmp_path / "nope.jinja")], None,
         "nope.jinja cannot be read"),
    ]
    for argv, content, msg in cases:
        if content is not None:
            bad.write_text(content)
        assert generate_main(["--hf", str(tiny), *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and msg in err, err
    assert generate_main(["--hf", str(no_template), "--chat", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no chat template" in err and "--chat-template FILE" in err, err
