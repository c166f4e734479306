"""`python -m engine train-draft`: train a DFlash draft for a target from the target's own greedy outputs.

1. Data: prompts, then the target's answers. Prompts come from engine/corpus.py's templates (seeded random ids
   for a target without a tokenizer); a share (--self-written, default 0.75) the target writes itself:
   after its chat template's user-turn header and a seeded opener ("Explain", "How do I", ...), it samples the
   rest of a user request (top-p 0.95), so the requests range over what the target knows, not over the templates'
   slots. All are answered greedily in the target's chat template. Both by the engine's own model
   (continue_prompts: prompts of one length batched together, no padding; the step replayed as a CUDA graph on
   GPUs), each answer for the full --new-tokens, past end-of-sequence. Saved once in OUT/data.pt, so a resumed
   run does not generate again.
2. Training, as the DFlash paper does: the target's hidden states after `target_layer_ids` are the context features
   (from the engine's own frozen model, as at inference; computed once for all sequences when they fit in memory); in
   each sequence, random anchor positions p in the answer; the block [token p, mask, ..., mask] at positions p..p+B-1
   sees the context features of positions < p and itself (non-causal) and predicts tokens p+1..p+B-1 in one pass;
   cross-entropy against the target's greedy tokens, weighted exp(-(j - 1) / gamma) by block position j; a share W
   (--distill W, default 0) of it replaced by the KL divergence to the target's whole next-token distribution at each
   label (its final hidden state at the position before, through the LM head): soft targets that also rank the
   runner-up tokens DDTree branches on. The target's embedding and LM head are borrowed and frozen, as at inference.
   Batches are drawn on the device. AdamW with warm-up and cosine decay, a fixed seed, bf16 autocast on GPUs, where
   each step's forward and backward replay as one CUDA graph.
3. Checkpoints every --save-every steps (OUT/checkpoint.pt, written atomically; --resume continues from it) and
   the draft in the public DFlash format (OUT/draft/: config.json + model.safetensors, or HF-style shards of at
   most 12 MB with an index), which `--draft OUT/draft` loads. At the end, the held-out acceptance: tau of DFlash
   and DDTree on engine.workloads.heldout_prompts().
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cross_entropy import cross_entropy
from kernels.fused import rmsnorm_reference, rope_reference

from .draft import DFlashDraftModel, draft_config
from .errors import EngineError
from .loading import Target
from .model import Rotary, Transformer
from .results import write_json
from .workloads import HELDOUT_TOKENS, heldout_prompts


def _setting(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainSettings:
    """The recipe; the defaults made the committed default draft (README). Each help text is its CLI option's."""
    out: str
    layers: int = _setting(5, "draft layers, each of the target's width")
    block_size: int = _setting(16, "tokens per draft block, the anchor's own included")
    prompts: int = _setting(106496, "training prompts, each answered by the target")
    new_tokens: int = _setting(256, "greedy answer tokens per prompt (past end-of-sequence)")
    gen_batch: int = _setting(2048, "prompts per batch while the target answers them")
    steps: int = _setting(43595, "optimizer steps (with --minutes: at most)")
    minutes: float = _setting(0.0, "if > 0, a time budget for the data and the steps together: the run measures its "
                                   "step rate and sets the step count that ends within it (logged, and saved in "
                                   "summary.json)")
    batch: int = _setting(32, "sequences per step")
    anchors: int = _setting(32, "random anchors (blocks) per sequence")
    lr: float = _setting(6e-4, "peak learning rate (linear warm-up, cosine to a tenth)")
    warmup: int = _setting(100, "warm-up steps")
    gamma: float = _setting(7.0, "loss weight exp(-(j-1)/gamma) of block position j")
    self_written: float = _setting(0.75, "share of the prompts the target writes itself (the rest from templates)")
    distill: float = _setting(0.0, "share of the loss that is the KL to the target's next-token distribution "
                                   "(the rest: cross-entropy on its argmax)")
    compile: bool = _setting(True, "compile the draft's training pass with torch.compile, which fuses its "
                                    "elementwise work (GPUs only)")
    save_every: int = _setting(1000, "steps between checkpoints (about 270 MB each with the optimizer state)")
    validation: int = _setting(512, "sequences of the data kept out of training (at most a tenth, whole batches): "
                                  "at every checkpoint the draft's teacher-forced acceptance on them is logged and "
                                  "the draft written is the best so far; 0: none, the last step's draft")
    seed: int = _setting(0, "seed of the data and of training")
    eval_tokens: int = _setting(HELDOUT_TOKENS, "new tokens per held-out prompt in the summary (as the perf "
                                                "suite's held-out floor)")


# ------------------------------------------------------------------------------------------------------- data

def sample_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """One id per row [b, 1], sampled at temperature 1 from the smallest set of most likely tokens whose mass reaches
    top_p. Exponential races instead of torch.multinomial: no host read, so a CUDA graph can hold it; the global
    generator's stream (torch.manual_seed) makes it repeatable."""
    # stable: of tied tokens the lowest id comes first, as argmax picks it (a nucleus of one token is greedy)
    probs, order = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True, stable=True)
    probs = probs * (probs.cumsum(-1) - probs < top_p)  # the most likely token always stays
    race = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)  # never 0 / 0
    choice = (probs / race).argmax(-1, keepdim=True)
    return order.gather(-1, choice)


@torch.no_grad()
def continue_prompts(model: Transformer, prompts: list[list[int]], new_tokens: int, batch: int,
                     desc: str = "generating answers", top_p: float | None = None) -> list[list[int]]:
    """new_tokens ids after each prompt from the engine's own model, never stopping early: greedy, or sampled with
    sample_top_p when top_p is given. Prompts of one length run together, up to `batch` rows: no padding, so all
    rows share the cache slots and positions and each greedy row is what decoding its prompt alone gives (up to the
    batched GEMMs' rounding). On a GPU the one-token step is captured as a CUDA graph per batch and replayed; the
    host never waits inside a batch."""
    from tqdm import tqdm

    from kernels import triton_disabled

    dev = model.device
    use_graphs = dev.type == "cuda" and not triton_disabled()
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    chunks = [idx[lo:lo + batch] for _, idx in sorted(by_length.items()) for lo in range(0, len(idx), batch)]
    rows: list[list[int]] = [[] for _ in prompts]
    one = torch.ones(1, 1, dtype=torch.bool, device=dev)

    def pick(hidden):
        logits = model.logits(hidden[:, -1])
        return logits.argmax(-1, keepdim=True) if top_p is None else sample_top_p(logits, top_p)

    for idx in tqdm(chunks, desc=desc, unit="batch", file=sys.stderr):
        n, b = len(prompts[idx[0]]), len(idx)
        cache = model.new_cache(n + new_tokens, batch=b)
        out = torch.empty(b, new_tokens, dtype=torch.long, device=dev)
        hidden, _ = model(torch.tensor([prompts[i] for i in idx], device=dev),
                          torch.arange(n, device=dev).expand(b, n), cache,
                          torch.ones(n, n, dtype=torch.bool, device=dev).tril())
        cache.start.fill_(n)
        token = pick(hidden)  # [b, 1], the step's static input and output

        def step():
            h, _ = model(token, cache.start.expand(b, 1), cache, one)
            cache.start.add_(1)
            token.copy_(pick(h))

        graph = None
        for t in range(new_tokens):
            out[:, t] = token[:, 0]
            if t == new_tokens - 1:
                break
            if graph is not None:
                graph.replay()
                continue
            step()  # eager; on a GPU also the warm-up before the capture
            if use_graphs:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()  # recorded, not run: the next replay is the next step
        for i, row in zip(idx, out.tolist()):
            rows[i] = row
        graph = cache = None  # free this batch's graph pool and cache before the next batch allocates its own
    return rows


def user_turn_prefix(target: Target) -> str | None:
    """The chat template's text before a user message's content (None without a chat template)."""
    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        return None
    marker = "\u2063USER\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    return text[:text.index(marker)] if marker in text else None


def self_written_prompts(target: Target, n: int, settings: TrainSettings) -> list[str]:
    """Up to n distinct user requests written by the target: a seeded opener after the user-turn header, then
    sampled by the engine's model (continue_prompts: temperature 1, top-p 0.95, seeded), cut at the end of the turn.
    Unfinished requests (no end of turn within 96 tokens), requests under three words and held-out prompts are
    dropped."""
    from .corpus import OPENERS

    prefix = user_turn_prefix(target)
    if prefix is None or n == 0:
        return []
    tok = target.tokenizer
    stops = set(target.stop_ids) | {tok.eos_token_id} - {None}
    picks = [i % len(OPENERS) for i in range(n + n // 4)]  # a quarter more: some are dropped
    heads = tok([prefix + o for o in OPENERS], add_special_tokens=False).input_ids
    torch.manual_seed(settings.seed)
    rows = continue_prompts(target.model, [heads[k] for k in picks], 96, settings.gen_batch, "writing prompts",
                            top_p=0.95)
    held, seen, out = set(heldout_prompts().values()), set(), []
    for k, row in zip(picks, rows):
        end = next((i for i, t in enumerate(row) if t in stops), None)
        if end is None:
            continue
        text = (OPENERS[k] + tok.decode(row[:end], skip_special_tokens=True)).strip()
        if len(text.split()) >= 3 and text not in seen and text not in held:
            seen.add(text)
            out.append(text)
    return out[:n]


def _prompt_ids(target: Target, settings: TrainSettings, log) -> list[list[int]]:
    from .corpus import training_prompts

    n = settings.prompts
    if target.tokenizer is None:  # a bare checkpoint: seeded random prompts of 8 to 48 ids
        rng = random.Random(settings.seed)
        vocab = target.model.cfg.vocab_size
        return [[rng.randrange(vocab) for _ in range(rng.randint(8, 48))] for _ in range(n)]
    written = self_written_prompts(target, round(n * settings.self_written), settings)
    templated = training_prompts(n - len(written), settings.seed)
    log(f"prompts: {len(written)} written by the target, {len(templated)} from templates")
    return [target.encode(p) for p in written + templated]


@torch.no_grad()
def generate_data(target: Target, settings: TrainSettings, log=print) -> list[dict]:
    """[{ids: prompt + greedy answer, prompt_len}], the answers from the engine's own model in the target's dtype
    (continue_prompts): what the engine itself decodes at that precision.

    Every answer runs the full settings.new_tokens, past end-of-sequence tokens: `bench` and the perf suite decode
    fixed lengths, so the draft must also know what the target writes after it would have stopped (new turns)."""
    prompts = _prompt_ids(target, settings, log)
    answers = continue_prompts(target.model, prompts, settings.new_tokens, settings.gen_batch)
    return [dict(ids=p + a, prompt_len=len(p)) for p, a in zip(prompts, answers)]


# ---------------------------------------------------------------------------------------------------- model

def new_draft(target: Target, settings: TrainSettings, mask_token_id: int) -> DFlashDraftModel:
    dcfg = draft_config(target.model.cfg, settings.layers, settings.block_size, mask_token_id)
    torch.manual_seed(settings.seed)
    draft = DFlashDraftModel(dcfg)
    for name, p in draft.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.ones_(p)  # norms
    return draft


def pick_mask_token(target: Target) -> int:
    """A special token that ordinary text never contains (the draft learns its embedding's meaning), else the last
    id of the vocabulary."""
    tok = target.tokenizer
    if tok is not None:
        common = set(target.stop_ids) | {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
        for token_id in sorted(getattr(tok, "all_special_ids", []), reverse=True):
            if token_id not in common and 0 <= token_id < target.model.cfg.vocab_size:
                return int(token_id)
    return target.model.cfg.vocab_size - 1


def _norm(x, weight, eps):
    return rmsnorm_reference(x, weight, eps)[0]  # plain PyTorch: differentiable


def draft_logits_train(draft: DFlashDraftModel, rotary: Rotary, embed_w, head_w, feats, tokens, anchors):
    """Differentiable draft pass for anchors [N, A]: logits [N, A, B-1, V] of block positions 1..B-1.

    Block a of sequence n: [tokens[n, p], mask...] at positions p..p+B-1 (p = anchors[n, a]); it sees the context
    features of positions < p and its own B rows, as DFlashDrafter.propose does at inference."""
    dcfg, cfg = draft.dcfg, draft.dcfg.layers
    N, L = tokens.shape
    A, B = anchors.shape[1], dcfg.block_size
    H, nh, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dev = tokens.device
    ctx = _norm(draft.fc(feats), draft.hidden_norm.weight, cfg.rms_norm_eps)             # [N, L, H]
    offs = torch.arange(B, device=dev)
    blk_pos = (anchors[..., None] + offs).reshape(N, A * B)                                # [N, A*B]
    blk_ids = torch.full((N, A, B), dcfg.mask_token_id, dtype=torch.long, device=dev)
    blk_ids[..., 0] = tokens.gather(1, anchors)
    x = F.embedding(blk_ids.view(N, A * B), embed_w)
    ctx_pos = torch.arange(L, device=dev)
    # visibility [N, A*B, L + A*B]: context keys before the anchor, then the block's own rows
    see_ctx = ctx_pos[None, None, :] < anchors.repeat_interleave(B, dim=1)[..., None]
    blk = torch.arange(A, device=dev).repeat_interleave(B)
    see_blk = (blk[:, None] == blk[None, :]).expand(N, -1, -1)
    mask = torch.cat((see_ctx, see_blk), dim=-1)[:, None]
    cos_c, sin_c = rotary(ctx_pos[None].expand(N, L), x.dtype)
    cos_b, sin_b = rotary(blk_pos, x.dtype)
    cos_k, sin_k = torch.cat((cos_c, cos_b), 1), torch.cat((sin_c, sin_b), 1)
    for layer in draft.layers:
        a = layer.self_attn
        h = _norm(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = _norm(a.q_proj(h).view(N, A * B, nh, d), a.q_norm.weight, cfg.rms_norm_eps).transpose(1, 2)
        kv_in = torch.cat((ctx, h), dim=1)
        k = _norm(a.k_proj(kv_in).view(N, -1, nkv, d), a.k_norm.weight, cfg.rms_norm_eps).transpose(1, 2)
        v = a.v_proj(kv_in).view(N, -1, nkv, d).transpose(1, 2)
        q = rope_reference(q, cos_b, sin_b)
        k = rope_reference(k, cos_k, sin_k)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nh != nkv)
        x = x + a.o_proj(o.transpose(1, 2).reshape(N, A * B, nh * d))
        m = layer.mlp
        h = _norm(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
    # rows 1..B-1 of every block as one contiguous [rows, H] matrix: a single GEMM against the LM head (a strided
    # 4-d operand made matmul run a batched GEMM per sequence: 12.3 ms of a 53.8 ms step on the H200, 43.9 after)
    out = _norm(x.view(N, A, B, H)[:, :, 1:].reshape(-1, H), draft.norm.weight, cfg.rms_norm_eps)
    return (out @ head_w.t()).view(N, A, B - 1, -1)


def target_block_logits(final_hidden, head_w, anchors, block_size: int) -> torch.Tensor:
    """The target's logits for tokens p+1..p+B-1 of each block [N, A, B-1, V]: its final (normed) hidden states at
    positions p..p+B-2 through the LM head. Positions past the end are clamped (block_loss masks them)."""
    N, L, H = final_hidden.shape
    pos = (anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)).clamp(max=L - 1)
    rows = final_hidden.gather(1, pos.view(N, -1, 1).expand(-1, -1, H)).view(*pos.shape, H)
    return rows @ head_w.t()


def block_labels(tokens, anchors, lengths, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens p+1..p+n after each anchor p [N, A, n], and whether they lie inside their sequence."""
    N, A = anchors.shape
    pos = anchors[..., None] + torch.arange(1, n + 1, device=tokens.device)
    labels = tokens.gather(1, pos.clamp(max=tokens.shape[1] - 1).view(N, -1)).view(N, A, n)
    return labels, pos < lengths[:, None, None]


def accepted_prefix(logits, tokens, anchors, lengths) -> torch.Tensor:
    """Teacher-forced acceptance of each block [N, A]: how many of its drafted tokens p+1.. match the target's
    greedy tokens before the first miss (a position past the sequence's end is a miss)."""
    labels, valid = block_labels(tokens, anchors, lengths, logits.shape[2])
    return ((logits.argmax(-1) == labels) & valid).long().cumprod(-1).sum(-1)


def block_loss(logits, tokens, anchors, lengths, gamma: float, teacher=None, distill: float = 0.0):
    """Weighted cross-entropy against tokens p+1..p+B-1 (positions past a sequence's end do not count); with
    `teacher` logits (target_block_logits, given when distill > 0), a share `distill` of it is the KL(teacher ||
    draft) instead. Also the share of block positions whose argmax is right."""
    N, A, Bm1, V = logits.shape
    labels, valid = block_labels(tokens, anchors, lengths, Bm1)
    j = torch.arange(1, Bm1 + 1, device=tokens.device)
    weight = torch.exp(-(j - 1).float() / gamma) * valid
    if teacher is None:  # one kernel pass on a GPU, no float32 copies of the logits (kernels.cross_entropy)
        per_position, argmax = cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
        per_position, argmax = per_position.view(N, A, Bm1), argmax.view(N, A, Bm1)
    else:
        logp = F.log_softmax(logits.float(), dim=-1)
        kl = F.kl_div(logp, F.log_softmax(teacher.float(), dim=-1), log_target=True, reduction="none").sum(-1)
        per_position = (1 - distill) * -logp.gather(-1, labels[..., None])[..., 0] + distill * kl
        argmax = logits.detach().argmax(-1)
    loss = (per_position * weight).sum() / weight.sum().clamp(min=1e-6)
    right = ((argmax == labels) & valid).sum() / valid.sum().clamp(min=1)
    return loss, right


# ------------------------------------------------------------------------------------------------ training

def pack(data, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All sequences in one zero-padded id tensor, with their lengths and prompt lengths, on the device: a batch is
    then drawn there (_batch), with no host work and no wait for the GPU between steps."""
    lengths = torch.tensor([len(d["ids"]) for d in data])
    tokens = torch.zeros(len(data), int(lengths.max()), dtype=torch.long)
    for n, d in enumerate(data):
        tokens[n, :len(d["ids"])] = torch.tensor(d["ids"])
    prompt_lens = torch.tensor([d["prompt_len"] for d in data])
    return tokens.to(device), lengths.to(device), prompt_lens.to(device)


def _batch(packed, idx: torch.Tensor, n_anchors: int, gen: torch.Generator):
    """Sequences idx and n_anchors random anchors in each, drawn with `gen` on the packed data's device."""
    all_tokens, all_lengths, all_prompt_lens = packed
    lengths, lo = all_lengths[idx], all_prompt_lens[idx]
    # every batch at the full packed width, not its own longest sequence: one shape for every step. The step is
    # bound by the host, and a shape that changes each step cost a third of the speed on the H200 (10.0 against
    # 14.9 steps/s); the padding is masked like any other (block_loss, causal features).
    tokens = all_tokens[idx]
    # anchors in the answer, with at least one label after them: p in [prompt_len, len - 2]
    span = (lengths - 1 - lo).clamp(min=1)
    anchors = lo[:, None] + (torch.rand(len(idx), n_anchors, generator=gen, device=gen.device) * span[:, None]).long()
    return tokens, lengths, anchors


def target_features(model: Transformer, width: int, batch: int, layers: tuple[int, ...]):
    """fn(tokens [batch, width]) -> (final hidden states, context features of `layers`): the target's forward over
    whole sequences from position 0, causal (no node_mask), the same blocks and kernels as at inference, in one cache
    of that shape reused by every call. Padding at the end never reaches a real row."""
    cache = model.new_cache(width, batch=batch)
    positions = torch.arange(width, device=model.device).expand(batch, width)
    return lambda tokens: model(tokens, positions, cache, None, capture=layers)


# The share of the device's free memory that the feature bank may take: the step's own buffers need the rest. The
# default recipe's bank: about 33 M positions x 5 layers x 576 values, 179 GiB in bfloat16, 90 GiB in float8.
FEATURE_BANK_SHARE = 0.7


class Float8Rows:
    """Feature rows [n, layers * hidden] kept as float8 e4m3 with one float32 scale per row and layer (its largest
    magnitude maps to 448, e4m3's largest): half the bytes of bfloat16, each value within 1/16 of itself (3 mantissa
    bits). Indexing returns the rows in `dtype`, like a plain bank tensor."""

    def __init__(self, n: int, layers: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.values = torch.empty(n, layers, hidden, dtype=torch.uint8, device=device)  # e4m3 bits
        self.scales = torch.empty(n, layers, 1, dtype=torch.float32, device=device)
        self.dtype, self.shape = dtype, (n, layers * hidden)

    @staticmethod
    def nbytes(n: int, layers: int, hidden: int) -> int:
        """What Float8Rows(n, layers, hidden) takes: a byte per value, a float32 scale per row and layer."""
        return n * layers * (hidden + 4)

    def __setitem__(self, rows: slice, x: torch.Tensor) -> None:
        x = x.float().unflatten(-1, self.values.shape[1:])
        scale = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 448.0
        self.values[rows] = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        self.scales[rows] = scale

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        # gathered as bytes: indexing works on uint8 everywhere, then one conversion of the rows taken
        values = self.values[idx].view(torch.float8_e4m3fn).float()
        return (values * self.scales[idx]).flatten(-2).to(self.dtype)


def free_memory(dev: torch.device) -> int:
    """Bytes the feature bank may draw on: free on the GPU plus what PyTorch holds unused (the data's caches and
    graphs), or the host's available memory."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@torch.no_grad()
def feature_bank(model: Transformer, packed, layers: tuple[int, ...], batch: int, log=print
                 ) -> tuple[torch.Tensor | Float8Rows, torch.Tensor] | None:
    """The target's context features at every position of every packed sequence, computed once: (bank [sum of
    lengths, len(layers) * hidden], start row of each sequence). The target is frozen, so running it in every step
    recomputes the same rows (10.4 of a 36.8 ms step on the H200). Kept in the model's dtype when that takes at most
    FEATURE_BANK_SHARE of the free memory, else as Float8Rows when those fit (about twice the data); else None, with
    a log line, and train() runs the target in every step."""
    from tqdm import tqdm

    tokens, lengths, _ = packed
    N, W = tokens.shape
    dev, dtype = tokens.device, model.embed_tokens.weight.dtype
    positions, hidden = int(lengths.sum()), model.cfg.hidden_size
    width = len(layers) * hidden
    need, need_fp8 = positions * width * dtype.itemsize, Float8Rows.nbytes(positions, len(layers), hidden)
    free = free_memory(dev)
    if need <= FEATURE_BANK_SHARE * free:
        bank, kind = torch.empty(positions, width, dtype=dtype, device=dev), str(dtype).removeprefix("torch.")
    elif need_fp8 <= FEATURE_BANK_SHARE * free:
        bank, kind = Float8Rows(positions, len(layers), hidden, dtype, dev), "float8 e4m3"
        need = need_fp8
    else:
        log(f"features: the target runs in every step (computing them once would take {need / 2**30:.1f} GiB, "
            f"{need_fp8 / 2**30:.1f} GiB in float8; {free / 2**30:.1f} GiB free)")
        return None
    t0 = time.perf_counter()
    starts = lengths.cumsum(0) - lengths
    features_of = target_features(model, W, batch, layers)
    first = starts.tolist()
    for lo in tqdm(range(0, N, batch), desc="target features", unit="batch", file=sys.stderr):
        chunk = tokens[lo:lo + batch]
        n = len(chunk)
        if n < batch:  # the cache's batch is fixed: pad the last chunk with copies of its first row
            chunk = torch.cat((chunk, chunk[:1].expand(batch - n, W)))
        _, feats = features_of(chunk)
        real = torch.arange(W, device=dev) < lengths[lo:lo + n, None]
        rows = feats[:n][real]  # each sequence's positions in order, the sequences one after another
        bank[first[lo]:first[lo] + len(rows)] = rows
    log(f"features: {positions} positions x {width} computed once, kept in {kind} ({need / 2**30:.1f} GiB of "
        f"{free / 2**30:.1f} GiB free, {time.perf_counter() - t0:.0f} s)")
    return bank, starts


def bank_rows(packed, starts: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The feature-bank row of every position of sequences idx [b, W]. Positions past a sequence's end repeat its
    last row: padding, never in a real position's context."""
    lengths, W = packed[1][idx], packed[0].shape[1]
    offsets = torch.arange(W, device=idx.device).minimum(lengths[:, None] - 1)
    return starts[idx, None] + offsets


# Steps of a run between which a time budget (--minutes) measures the step rate: after the CUDA graph's warm-up.
RATE_WINDOW = (20, 220)


def steps_in_budget(settings: TrainSettings, step: int, rate: float, elapsed_s: float) -> int:
    """The step count that ends the run within settings.minutes: what the measured rate fits in the time left, less
    5% for checkpoints and jitter; never more than settings.steps, never fewer than the steps done."""
    left = settings.minutes * 60 - elapsed_s
    return max(step, min(settings.steps, step + int(0.95 * rate * left)))


def _lr(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_dflash(draft: DFlashDraftModel, target: Target, out: Path, dtype=torch.bfloat16,
                max_shard_bytes: int = 12 << 20) -> None:
    """The public DFlash format (DESIGN.md section 2), written to a temporary folder and renamed into place."""
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
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
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
        for path in (tmp, *tmp.iterdir()):  # mkdtemp's 0700: readable by all
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def graphed_step(fn, params, example: tuple[torch.Tensor, ...]):
    """fn(*batch) -> outputs, run once on `example` (warm-up, gradients discarded), then captured as one CUDA graph;
    the returned step copies a batch into the graph's inputs and replays it. Every batch has one shape (_batch),
    and eagerly the step is bound by the host: about 4,900 kernel launches for 40 ms of GPU work on the H200.
    fn's backward leaves the gradients in the graph's own tensors, which each replay overwrites: no zero_grad."""
    inputs = tuple(x.clone() for x in example)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*inputs)

    def step(*batch):
        for dst, src in zip(inputs, batch):
            dst.copy_(src)
        graph.replay()
        return outputs
    return step


def train(target: Target, settings: TrainSettings, device, resume: bool = False, log=print,
          cuda_graph: bool = True) -> Path:
    """Train (or with `resume`, continue) a draft per `settings`; returns its DFlash directory. On a GPU each step's
    forward and backward replay as one CUDA graph (graphed_step), unless cuda_graph is False."""
    from tqdm import tqdm

    out = Path(settings.out)
    ckpt_path, data_path = out / "checkpoint.pt", out / "data.pt"
    if ckpt_path.exists() and not resume:
        raise EngineError(f"{out} already holds a training run: pass --resume to continue it, or another --out")
    out.mkdir(parents=True, exist_ok=True)
    amp = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    if data_path.exists():
        data = torch.load(data_path)["data"]
        log(f"data: {len(data)} sequences from {data_path}")
    else:
        data = generate_data(target, settings, log=log)
        _atomic_save(dict(data=data, settings=asdict(settings)), data_path)
        log(f"data: {len(data)} sequences, {sum(len(d['ids']) - d['prompt_len'] for d in data)} answer tokens, "
            f"{time.perf_counter() - t0:.0f} s")
    draft = new_draft(target, settings, pick_mask_token(target)).to(device)
    # fused: one launch for the whole update (the step is bound by the host)
    opt = torch.optim.AdamW(draft.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    step, checks = 0, []  # checks: the validation record, {step, tau, loss} per checkpoint
    if resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location=device)
        draft.load_state_dict(ck["draft"])
        opt.load_state_dict(ck["optimizer"])
        step, checks = ck["step"], ck.get("validation", [])
        log(f"resuming at step {step}")
    model = target.model  # frozen; its embedding and LM head are the draft's, as at inference
    embed_w, head_w = model.embed_tokens.weight, model.lm_head.weight
    rotary = Rotary(model.cfg.hf, draft.dcfg.layers.head_dim, device)
    packed = pack(data, device)
    # the validation sequences: a seeded choice of whole batches, never drawn for a step
    n_val = min(settings.validation, len(data) // 10) // settings.batch * settings.batch
    if n_val:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(settings.seed)).to(device)
        val_idx, train_idx = order[:n_val], order[n_val:]
        log(f"validation: {n_val} sequences kept out of training")
    else:
        val_idx, train_idx = None, torch.arange(len(data), device=device)
        if settings.validation:
            log(f"validation: none (a tenth of {len(data)} sequences is less than one batch of {settings.batch})")
    # the context features as at inference (target_features), computed once for all sequences when they fit
    # (feature_bank), else in every step; distillation also needs the target's final hidden states, so it runs the
    # target in every step.
    layers = draft.dcfg.target_layer_ids
    bank = feature_bank(model, packed, layers, settings.batch, log) if settings.distill == 0 else None
    if bank is None:
        features_of = target_features(model, packed[0].shape[1], settings.batch, layers)
    else:
        bank_features, bank_starts = bank

    draft_pass = draft_logits_train
    if settings.compile and device.type == "cuda":  # compiled in the first call: the CUDA graph's warm-up
        draft_pass = torch.compile(draft_logits_train)

    @torch.no_grad()
    def context_features(tokens, rows=None):
        """(the target's final hidden states or None, context features) of a batch: its bank rows, or the target."""
        return (None, bank_features[rows]) if rows is not None else features_of(tokens)

    def loss_and_grads(tokens, lengths, anchors, rows=None):
        final_hidden, feats = context_features(tokens, rows)
        # no autocast weight cache: a CUDA graph must not keep casts made during its capture
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32, cache_enabled=False):
            logits = draft_pass(draft, rotary, embed_w, head_w, feats, tokens, anchors)
            teacher = None
            if settings.distill > 0:
                with torch.no_grad():
                    teacher = target_block_logits(final_hidden, head_w, anchors, settings.block_size)
            loss, right = block_loss(logits, tokens, anchors, lengths, settings.gamma, teacher=teacher,
                                     distill=settings.distill)
        loss.backward()
        return loss.detach(), right

    # batches are drawn on the device; a resumed run draws new ones
    gen = torch.Generator(device=device).manual_seed(settings.seed * 1_000_003 + step)

    def draw(idx, generator):
        batch = _batch(packed, idx, settings.anchors, generator)
        return batch if bank is None else (*batch, bank_rows(packed, bank_starts, idx))

    def next_batch():
        return draw(train_idx[torch.randint(len(train_idx), (settings.batch,), generator=gen, device=device)], gen)

    # the same validation blocks at every check: anchors drawn once, from their own seed
    val_gen = torch.Generator(device=device).manual_seed(settings.seed + 1)
    val_batches = [draw(val_idx[i:i + settings.batch], val_gen) for i in range(0, n_val, settings.batch)]

    @torch.no_grad()
    def validate() -> tuple[float, float]:
        """(teacher-forced tau: 1 + the mean accepted_prefix, mean loss) over the validation blocks; eager, a few
        batches per checkpoint."""
        prefix, loss = 0, 0.0
        for tokens, lengths, anchors, *rows in val_batches:
            feats = context_features(tokens, *rows)[1]
            with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
                logits = draft_logits_train(draft, rotary, embed_w, head_w, feats, tokens, anchors)
                loss += block_loss(logits, tokens, anchors, lengths, settings.gamma)[0]
            prefix += accepted_prefix(logits, tokens, anchors, lengths).sum()
        return 1 + float(prefix) / (n_val * settings.anchors), float(loss) / len(val_batches)

    draft.train()
    batch = next_batch()

    def eager_step(*batch):
        opt.zero_grad(set_to_none=True)
        return loss_and_grads(*batch)

    run_step = eager_step
    if device.type == "cuda" and cuda_graph:
        try:  # the first batch warms up the capture, then trains as the first step below
            run_step = graphed_step(loss_and_grads, list(draft.parameters()), batch)
        except RuntimeError as e:  # an op that cannot be captured (a host read in a library's forward)
            log(f"warning: training without a CUDA graph ({str(e).splitlines()[0]})")
            torch.cuda.synchronize()
    bar = tqdm(total=settings.steps, initial=step, desc="training", unit="step", file=sys.stderr)
    first_step, t_steps = step, time.perf_counter()
    while step < settings.steps:
        loss, right = run_step(*batch)
        batch = next_batch()
        for group in opt.param_groups:
            group["lr"] = _lr(step, settings)
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update()
        if settings.minutes > 0 and step - first_step in RATE_WINDOW:  # two host waits in the whole run
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step - first_step == RATE_WINDOW[0]:
                t_rate = time.perf_counter()
            else:
                now = time.perf_counter()
                used, rate = now - t0, (RATE_WINDOW[1] - RATE_WINDOW[0]) / (now - t_rate)
                settings.steps = bar.total = steps_in_budget(settings, step, rate, used)
                log(f"time budget {settings.minutes:g} min: {used:.0f} s used by the data and {step} steps, "
                    f"{rate:.2f} steps/s measured: {settings.steps} steps in all")
        if step % 10 == 0 or step == settings.steps:  # .item() waits for the GPU: not every step
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{right.item():.2f}")
        if step % settings.save_every == 0 or step == settings.steps:
            best = True  # without validation: every checkpoint's draft
            if n_val:
                tau, val_loss = validate()
                best = all(tau > c["tau"] for c in checks)
                checks.append(dict(step=step, tau=tau, loss=val_loss))
                write_json(out / "validation.json", dict(sequences=n_val, checks=checks))
                bar.write(f"step {step}: validation tau {tau:.3f}, loss {val_loss:.3f}"
                          + (" (best so far: draft written)" if best else ""), file=sys.stderr)
            _atomic_save(dict(draft=draft.state_dict(), optimizer=opt.state_dict(), step=step,
                              settings=asdict(settings), validation=checks), ckpt_path)
            if best:
                save_dflash(draft, target, out / "draft")
    bar.close()
    steps_s = time.perf_counter() - t_steps
    kept = ""
    if checks:
        top = max(checks, key=lambda c: c["tau"])
        kept = f" (step {top['step']}'s, the best validation tau {top['tau']:.3f})"
    log(f"trained {settings.steps} steps; {time.perf_counter() - t0:.0f} s in this run, of which the steps "
        f"{steps_s:.0f} s ({(settings.steps - first_step) / max(steps_s, 1e-9):.2f} steps/s, checkpoints "
        f"included); draft{kept}: {out / 'draft'}")
    return out / "draft"


def heldout_acceptance(target: Target, draft_dir: Path, new_tokens: int, methods=("dflash", "ddtree-15", "ddtree-32")
                       ) -> dict[str, float]:
    """tau per method over the held-out set (engine.workloads.heldout_prompts(); `bench --workloads heldout`),
    every output checked against AR."""
    from .bench import Method, pooled_tau, run_matrix
    from .loading import load_drafter

    records = run_matrix(target, load_drafter(str(draft_dir), target), [Method.parse(m, topk_cap=8) for m in methods],
                         list(heldout_prompts()), {"heldout": new_tokens}, warmup=0, progress=False)
    diverged = next((r for r in records if not r["lossless"]), None)
    if diverged is not None:
        raise EngineError(f"held-out check: {diverged['method']} diverged from AR on {diverged['workload']}: "
                          f"{diverged['exactness']}")
    return {m: pooled_tau([r for r in records if r["method"] == m]) for m in methods}
