"""The training data: prompts (templates and requests the target writes itself), the target's greedy answers, and
batches drawn on the device.

Prompts come from corpus.py's templates (seeded random ids for a target without a tokenizer); a share
(--self-written) the target writes itself: after its chat template's user-turn header and a seeded opener
("Explain", "How do I", ...), it samples the rest of a user request (top-p 0.95), so the requests range over what
the target knows, not over the templates' slots. All are answered greedily by the engine's own model in the
target's dtype (continue_prompts), each for the full --new-tokens, past end-of-sequence.
"""
from __future__ import annotations

import random
import sys

import torch

from ..errors import EngineError
from ..loading import Target
from ..model import Transformer
from ..workloads import heldout_prompts, prompt_ids
from .corpus import OPENERS, training_prompts
from .settings import TrainSettings


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
    # a hybrid's keep_prefix makes its length tensor on the host, which a CUDA graph cannot capture: eager there
    use_graphs = dev.type == "cuda" and not triton_disabled() and not model.cfg.hybrid
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
        cache.keep_prefix(n)  # a hybrid's recurrent states: the prompt's last row (attention rows are in place)
        cache.start.fill_(n)
        token = pick(hidden)  # [b, 1], the step's static input and output

        def step():
            h, _ = model(token, cache.start.expand(b, 1), cache, one)
            cache.keep_prefix(1)
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


def training_prompt_ids(target: Target, settings: TrainSettings, log) -> list[list[int]]:
    n = settings.prompts
    if target.tokenizer is None:  # a bare checkpoint: seeded random prompts of 8 to 48 ids
        rng = random.Random(settings.seed)
        vocab = target.model.cfg.vocab_size
        return [[rng.randrange(vocab) for _ in range(rng.randint(8, 48))] for _ in range(n)]
    written = self_written_prompts(target, round(n * settings.self_written), settings)
    templated = training_prompts(n - len(written), settings.seed)
    log(f"prompts: {len(written)} written by the target, {len(templated)} from templates")
    return [target.encode(p) for p in written + templated]


def check_positions(target: Target, settings: TrainSettings, prompts: list[list[int]] | None = None) -> None:
    """Refuse sequences past the target's position limit before the target answers anything: with the prompts, the
    longest prompt plus --new-tokens; without them (before the target writes its own), --new-tokens after a
    one-token prompt, and the held-out check's longest prompt plus --eval-tokens (the check runs after training)."""
    limit = target.model.cfg.max_position

    def fits(option, value, prompt, longest):
        if longest + value > limit:
            raise EngineError(f"{option} {value} plus {prompt} ({longest} token{'s' * (longest != 1)}) is "
                              f"{longest + value} positions, past the target's position limit of {limit}")

    if prompts is not None:
        fits("--new-tokens", settings.new_tokens, "the longest training prompt", max(map(len, prompts)))
        return
    fits("--new-tokens", settings.new_tokens, "the shortest possible prompt", 1)
    fits("--eval-tokens", settings.eval_tokens, "the longest held-out prompt",
         max(len(prompt_ids(target, w)) for w in heldout_prompts()))


@torch.no_grad()
def generate_data(target: Target, settings: TrainSettings, log=print) -> list[dict]:
    """[{ids: prompt + greedy answer, prompt_len}], the answers from the engine's own model in the target's dtype
    (continue_prompts): what the engine itself decodes at that precision.

    Every answer runs the full settings.new_tokens, past end-of-sequence tokens: `bench` and the perf suite decode
    fixed lengths, so the draft must also know what the target writes after it would have stopped (new turns)."""
    prompts = training_prompt_ids(target, settings, log)
    check_positions(target, settings, prompts)
    answers = continue_prompts(target.model, prompts, settings.new_tokens, settings.gen_batch)
    return [dict(ids=p + a, prompt_len=len(p)) for p, a in zip(prompts, answers)]


def pack(data, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All sequences in one zero-padded id tensor, with their lengths and prompt lengths, on the device: a batch is
    then drawn there (draw_batch), with no host work and no wait for the GPU between steps."""
    lengths = torch.tensor([len(d["ids"]) for d in data])
    tokens = torch.zeros(len(data), int(lengths.max()), dtype=torch.long)
    for n, d in enumerate(data):
        tokens[n, :len(d["ids"])] = torch.tensor(d["ids"])
    prompt_lens = torch.tensor([d["prompt_len"] for d in data])
    return tokens.to(device), lengths.to(device), prompt_lens.to(device)


def draw_batch(packed, idx: torch.Tensor, n_anchors: int, gen: torch.Generator):
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
