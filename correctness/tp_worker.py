"""Run under torchrun by correctness/test_tensor_parallel.py: one target at the group's width against itself at
width 1, on every rank; rank 0 writes what it measured as JSON.

    torchrun --standalone --nproc_per_node=2 -m correctness.tp_worker OUT.json TARGET [TARGET ...]

Per target: the prefill logits of a prompt at width 1 and sharded (max abs difference), greedy AR at width 1 and
sharded (tokens), and DFlash / DDTree at the sharded width with a random draft and with the oracle drafter
(multi-token acceptance, side branches) compared with sharded AR under the exactness rule; the random drafts also
sharded, and with int8 weights.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import engine
from engine.draft import DraftInput
from engine.exactness import compare_tokens, tolerance_for
from engine.parallel import exit_rank, init_tensor_parallel, shard_target
from engine.results import write_json

from .checkpoints import random_draft_context

NEW_TOKENS = 40
CASES = (("dflash", 0, "random:1"), ("dflash", 0, "oracle"), ("ddtree", 4, "random:1"), ("ddtree", 15, "oracle"),
         ("ddtree", 6, "oracle"), ("dflash", 0, "sharded random:2"), ("ddtree", 6, "sharded random:2"),
         ("ddtree", 6, "int8 random:2"), ("ddtree", 6, "w8a8 random:2"))
# int8 / w8a8: the replicated draft with int8 weights (w8a8: and int8 rows) and its LM head's vocab shard


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(64)
    n = len(ids)
    hidden, _ = model(torch.tensor([ids]), torch.arange(n)[None], cache, torch.ones(n, n, dtype=torch.bool).tril())
    return model.logits(hidden[0])


def check_target(spec: str, tp) -> dict:
    target = engine.load_target(spec, "cpu", torch.float32)
    vocab = target.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, vocab, (13,), generator=gen).tolist() + [1, 2] + [5, 7]  # special ids inside too
    full_logits = prefill_logits(target.model, ids)
    full_ar = engine.Decoder(target.model).generate(ids, NEW_TOKENS, record_margins=True)
    target = engine.load_target(spec, "cpu", torch.float32)  # again: the decoder above folded the norms of that one
    shard_target(target.model, tp)
    logits = prefill_logits(target.model, ids)
    ar = engine.Decoder(target.model).generate(ids, NEW_TOKENS, record_margins=True)
    tol = tolerance_for(torch.float32)
    out = dict(logits_max_abs_diff=(logits - full_logits).abs().max().item(),
               logits_scale=full_logits.abs().max().item(),
               ar_vs_width1=compare_tokens(full_ar.tokens, full_ar.margins, ar.tokens, tol).describe(),
               ar_vs_width1_ok=compare_tokens(full_ar.tokens, full_ar.margins, ar.tokens, tol).ok, methods={})
    for method, budget, draft in CASES:
        if draft == "oracle":
            drafter = engine.OracleDrafter(ids + ar.tokens, vocab, 8, miss_rate=0.3, seed=3)
        else:
            *how, spec = draft.split()
            drafter = engine.load_drafter(spec, target, block_size=8, shard="sharded" in how,
                                          weights=next((w for w in ("int8", "w8a8") if w in how), "model"))
        result = engine.Decoder(target.model, drafter, engine.DecodeSettings(method, budget)).generate(ids, NEW_TOKENS)
        verdict = compare_tokens(ar.tokens, ar.margins, result.tokens, tol)
        out["methods"][f"{method}-{budget}-{draft}"] = dict(ok=verdict.ok, verdict=verdict.describe(),
                                                              tau=result.tau)
    out.update(sharded_draft_logits(target))
    return out


def sharded_draft_logits(target) -> dict:
    """A random draft's block logits replicated and sharded (engine.parallel.shard_draft), from the same weights and
    inputs: the same function, summed in another order."""
    drafters = [engine.load_drafter("random:2", target, block_size=8, seed=5, shard=s) for s in (False, True)]
    features, tokens = random_draft_context(target, drafters, 16, prompt_len=9)
    diff = scale = 0.0
    seen = 0
    for new in (9, 3, 4):  # the prompt's features, then two rounds' accepted tokens
        inp = DraftInput(tokens, torch.tensor(seen + new), features[:, seen:seen + new], torch.tensor(new))
        full, part = (d.propose(inp) for d in drafters)
        diff, scale = max(diff, (full - part).abs().max().item()), max(scale, full.abs().max().item())
        seen += new
    kv_heads = [d.cache.k.shape[2] for d in drafters]  # ModelCache.k: [layers, B, KV heads, capacity, D]
    return dict(draft_logits_max_abs_diff=diff, draft_logits_scale=scale, draft_cache_kv_heads=kv_heads)


def main() -> int:
    path, specs = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    tp, _ = init_tensor_parallel(int(os.environ["WORLD_SIZE"]))
    try:
        results = {spec: check_target(spec, tp) for spec in specs}
        if tp.rank == 0:
            write_json(path, dict(world=tp.world, targets=results))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())  # a torchrun rank: see engine.parallel.exit_rank
