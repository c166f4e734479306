"""Run under torchrun by correctness/test_hybrid_tp.py: a hybrid target sharded at the group's width decodes a
prompt with AR, DFlash and DDTree; rank 0 writes the prefill logits, the recurrent cache's per-rank shape and every
method's tokens as JSON, for the test to compare with the same runs at width 1.

    torchrun --standalone --nproc_per_node=4 -m correctness.hybrid_tp_worker OUT.json TARGET
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import engine
from engine.parallel import exit_rank, init_tensor_parallel, shard_target
from engine.results import write_json

from .tp_worker import prefill_logits

NEW_TOKENS = 20
# the oracle drafter forces multi-token acceptance, rejections and side branches (recurrent states kept along
# non-contiguous paths); the random draft runs a replicated draft model over the sharded embedding and LM head
CASES = (("dflash", 0, "oracle"), ("dflash", 0, "random:1"), ("ddtree", 15, "oracle"), ("ddtree", 32, "oracle"))


def prompt(target) -> list[int]:
    gen = torch.Generator().manual_seed(5)
    return torch.randint(3, target.model.cfg.vocab_size, (11,), generator=gen).tolist() + [1, 2, 7]


def decode_all(target) -> dict:
    """Prefill logits, the recurrent cache's shape, and the tokens (and tau) of AR and every case, at the target's
    current width."""
    ids, vocab = prompt(target), target.model.cfg.vocab_size
    cache = target.model.new_cache(8)
    recurrent = cache.recurrent[0]
    ar = engine.Decoder(target.model).generate(ids, NEW_TOKENS, record_margins=True)
    out = dict(logits=prefill_logits(target.model, ids).tolist(), state=list(recurrent.state.shape),
               window=list(recurrent.window.shape), ar=ar.tokens, margins=ar.margins, methods={})
    for method, budget, draft in CASES:
        if draft == "oracle":
            drafter = engine.OracleDrafter(ids + ar.tokens, vocab, 8, miss_rate=0.3, seed=budget)
        else:
            drafter = engine.load_drafter(draft, target, block_size=8)
        result = engine.Decoder(target.model, drafter, engine.DecodeSettings(method, budget)).generate(ids, NEW_TOKENS)
        out["methods"][f"{method}-{budget}-{draft}"] = dict(tokens=result.tokens, tau=result.tau)
    return out


def main() -> int:
    path, spec = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    tp, _ = init_tensor_parallel(int(os.environ["WORLD_SIZE"]))
    try:
        target = engine.load_target(spec, "cpu", torch.float32)
        shard_target(target.model, tp)
        results = decode_all(target)
        if tp.rank == 0:
            write_json(path, dict(world=tp.world, **results))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())  # a torchrun rank: see engine.parallel.exit_rank
