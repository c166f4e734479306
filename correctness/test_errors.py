"""Bad inputs give one clear error: engine.errors.EngineError from the API, and from the CLI return code 2 with a
single "error: ..." line on stderr (and no result file). Uses tiny random checkpoints written into tmp dirs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import DecodeSettings, Decoder, EngineError, load_drafter, load_target
from engine.cli import main

VOCAB, HIDDEN, LAYERS, MAX_POS = 128, 64, 2, 64
HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, 96
PROMPT = [1, 2, 3]


# ---------------------------------------------------------------------------------------------------- fixtures

def write_target(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                      max_position_embeddings=MAX_POS)
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


@pytest.mark.parametrize("spec", ["random:x", "random:0", "random:-1"])
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


@pytest.mark.parametrize("text", ["1,a,3", "1;2;3", "1.5,2", "0x10"])
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
