"""Tensor parallelism on torch.distributed: one process per GPU (NCCL) or per CPU worker (gloo), under torchrun.

Megatron-style sharding of a loaded target, in place (`shard_target`):
- attention: q/k/v column-parallel by whole GQA groups (as evenly as the KV heads allow), o_proj row-parallel
  followed by an all-reduce; the KV cache holds the rank's KV heads only. When the width exceeds the KV heads,
  each KV head is replicated on width / KVH ranks, which split its query heads;
- MLP: gate/up column-parallel (as evenly as the width allows), down row-parallel followed by an all-reduce;
- embedding and LM head vocabulary-parallel (padded to a multiple of the width): an embedding row is looked up
  on the rank that holds it and all-reduced; each rank's logits slice is all-gathered, so every rank holds the
  full logits and makes the same argmax, tree and acceptance decisions.
- a DFlash draft is replicated by default; with ENGINE_SHARD_DRAFT=1 its layers are sharded as the target's are
  (`shard_draft`: attention and MLP, an all-reduce after each), its feature projection and norms stay replicated.
  Every rank still gets the same draft logits: the all-reduce adds in a fixed order.
- Gated DeltaNet (hybrid targets) by key heads, each with its value heads: in_proj_qkv and the depthwise conv by their
  q, k and v channels, in_proj_z/b/a, dt_bias and A_log by value heads; out_proj row-parallel followed by an
  all-reduce; the recurrent state and conv window hold the rank's heads and channels only. A gated attention's
  q_proj keeps each head's query and gate rows together.
Row-parallel biases stay on rank 0 only, so the all-reduce adds them once.

With ENGINE_TP_FUSED_NORM=1, on GPUs (any width), the all-reduce after o_proj and down_proj is fused with the
RMSNorm and residual add that follow it (kernels.all_reduce): the projection's GEMM writes this rank's part straight
into a peer-readable buffer and returns a `Partial`, and the next norm reads every rank's part, adds them in rank
order and normalises, in one kernel with one barrier. Two slots: attention outputs use slot 0 and MLP outputs slot
1, so consecutive fused all-reduces alternate (or, in a hybrid, a Gated DeltaNet layer's own all-reduce lies between
two MLP outputs); a rank rewrites a slot only after its peers have signalled from the next call (or passed the
all-reduce between), which they reach only once their read of this slot is done, so no barrier is needed after the
read. Off by default until measured further: on two H200s it made the 8B's AR step 8-11% faster, and in the one A/B
on one machine DFlash and DDTree-15 (16-row verifies) 3-7% slower, with a kernel that still read the peers' rows 2
bytes at a time (docs/performance.md). Prefills longer than FUSED_ROWS rows take the plain path, whose bits are the
same (correctness/all_reduce_worker.py checks it on GPUs).

The all-reduce at width 2 is one addition per element, the same whatever the message size or the path (a one-shot
all-reduce over peer memory on GPUs, NCCL for long prefills and on CPUs gloo), so a verify pass still reproduces
the one-token step bit for bit; wider groups gather the partial sums and add them in rank order in
float32, for the same reason (NCCL's reduction order depends on the message size and the algorithm it picks).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .errors import EngineError, env_switch


# Width 2 on GPUs: messages up to this many bytes go through a one-shot all-reduce over peer memory (PyTorch's
# symmetric memory: each rank reads the other's buffer over NVLink and adds, barriers before and after), 6-10 us
# inside a CUDA graph on two H200s against NCCL's 11-15 us. Decode, verify and draft rows are far below it; long
# prefills go through NCCL, which gives the same single addition per element.
ONE_SHOT_BYTES = 4 << 20
FUSED_ROWS = 256  # rows (tokens) per call of the fused all-reduce + RMSNorm: decode, verify, draft blocks, batches
ATTENTION_SLOT, MLP_SLOT = 0, 1  # slots of the fused all-reduce's buffer (module docstring, "Two slots")


@dataclass
class Partial:
    """A row-parallel projection's output before its all-reduce: this rank's part, in `slot` of its peer-readable
    buffer (TensorParallel.row_parallel). The RMSNorm after it finishes the all-reduce in its own kernel
    (TensorParallel.all_reduce_rmsnorm); `reduced` is the plain all-reduce, for other readers."""
    part: torch.Tensor
    slot: int
    tp: "TensorParallel"

    def reduced(self) -> torch.Tensor:
        return self.tp.all_reduce(self.part.clone())  # a copy: the peers read the slot itself


@dataclass
class FusedBuffer:
    """The fused all-reduce + RMSNorm's peer-readable buffer: two slots of `rows` x hidden (kernels.all_reduce)."""
    buffer: torch.Tensor        # this rank's, flat
    buffer_ptrs: torch.Tensor   # int64 [world] on the device: every rank's buffer
    signal_pads: torch.Tensor   # int64 [world] on the device: every rank's signal pad
    rows: int                   # rows per slot

    def offset(self, slot: int, width: int) -> int:
        """Where `slot` starts, in elements: the same in every rank's buffer."""
        return slot * self.rows * width

    def slot(self, slot: int, rows: int, width: int) -> torch.Tensor:
        """[rows, width] at the start of `slot`."""
        start = self.offset(slot, width)
        return self.buffer[start: start + rows * width].view(rows, width)


@dataclass
class TensorParallel:
    rank: int
    world: int
    group: object = None  # the default process group
    one_shot: torch.Tensor | None = None  # flat symmetric-memory buffer (width 2 on GPUs), see enable_one_shot
    one_shot_group: str = ""  # the process group's name, as the symmetric-memory ops take it
    fused: FusedBuffer | None = None  # the fused all-reduce + RMSNorm's buffer, see enable_fused_norm

    def enable_one_shot(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the peer-readable buffer (a collective call: every rank, same order). Skipped, with NCCL
        kept, where PyTorch's symmetric memory is unavailable."""
        if self.world != 2 or device.type != "cuda" or self.one_shot is not None:
            return
        try:
            import torch.distributed._symmetric_memory as symm_mem

            name = dist.group.WORLD.group_name
            buf = symm_mem.empty(ONE_SHOT_BYTES // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, name)
        except (ImportError, RuntimeError, AttributeError) as e:
            if self.rank == 0:  # the same software fails alike on every rank: one line is enough
                print(f"tensor parallelism: symmetric memory unavailable ({type(e).__name__}: {e}); all-reduces "
                      f"use NCCL", file=sys.stderr)
            return
        self.one_shot, self.one_shot_group = buf, name

    def enable_fused_norm(self, device: torch.device, dtype: torch.dtype, hidden: int) -> None:
        """Allocate the fused all-reduce's two-slot buffer (a collective call: every rank, same order) when
        ENGINE_TP_FUSED_NORM=1. Skipped, with the plain all-reduce kept, off GPUs, without Triton, or where PyTorch's
        symmetric memory is unavailable."""
        from kernels import triton, triton_disabled

        if (env_switch("ENGINE_TP_FUSED_NORM") is not True or device.type != "cuda" or triton is None
                or triton_disabled() or self.fused is not None):
            return
        try:
            import torch.distributed._symmetric_memory as symm_mem

            rows = min(FUSED_ROWS, symm_mem.get_signal_pad_size() // 4 // self.world)
            buf = symm_mem.empty(2 * rows * hidden, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
            ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
            pads = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        except (ImportError, RuntimeError, AttributeError) as e:
            if self.rank == 0:
                print(f"tensor parallelism: no fused all-reduce + norm ({type(e).__name__}: {e}); the plain "
                      f"all-reduce is used", file=sys.stderr)
            return
        self.fused = FusedBuffer(buf, ptrs, pads, rows)

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     slot: int) -> "torch.Tensor | Partial":
        """A row-parallel projection x @ weight^T (+ bias): its all-reduce left to the norm after it (a Partial in
        `slot`) where the fused path takes it, else all-reduced here."""
        N, K = weight.shape
        rows = x.numel() // K
        fused = self.fused
        if (fused is None or rows > fused.rows or x.dtype != fused.buffer.dtype
                or 2 * fused.rows * N > fused.buffer.numel()):
            return self.all_reduce(F.linear(x, weight, bias))
        part = fused.slot(slot, rows, N)
        x2 = x.reshape(rows, K)
        if bias is None:
            torch.mm(x2, weight.t(), out=part)
        else:
            torch.addmm(bias, x2, weight.t(), out=part)
        return Partial(part.view(*x.shape[:-1], N), slot, self)

    def all_reduce_rmsnorm(self, p: Partial, weight: torch.Tensor, eps: float,
                           residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum of the parts + residual), sum of the parts + residual): kernels.all_reduce."""
        from kernels.all_reduce import all_reduce_rmsnorm_triton

        fused = self.fused
        return all_reduce_rmsnorm_triton(fused.buffer_ptrs, fused.signal_pads, self.rank,
                                         fused.offset(p.slot, p.part.shape[-1]), p.part, weight, eps, residual)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 2:
            buf = self.one_shot
            if buf is not None and x.dtype == buf.dtype and x.is_contiguous() and x.numel() <= buf.numel():
                staged = buf[:x.numel()]
                staged.copy_(x.view(-1))
                torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.one_shot_group, x.view(-1))
                return x
            dist.all_reduce(x, group=self.group)
            return x
        parts = self._gather(x)
        total = parts[0].float()
        for part in parts[1:]:
            total += part.float()
        return total.to(x.dtype)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's x (flat buffers: the form both NCCL and gloo accept)."""
        out = torch.empty(self.world * x.numel(), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous().view(-1), group=self.group)
        return out.view(self.world, *x.shape)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world * n], rank-major."""
        return self._gather(x).movedim(0, -2).reshape(*x.shape[:-1], self.world * x.shape[-1])


def init_tensor_parallel(tp: int) -> tuple[TensorParallel | None, torch.device | None]:
    """Join the torchrun group for width `tp` (1: nothing to do). Returns the group and this rank's device (a GPU
    per local rank where CUDA is present, else the CPU with gloo)."""
    if tp < 1:
        raise EngineError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        return None, None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise EngineError(f"--tp {tp} needs {tp} processes: run under `torchrun --nproc_per_node={tp} -m engine ...` "
                          f"(this is one of {world})")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if torch.cuda.device_count() <= local:
            raise EngineError(f"--tp {tp}: local rank {local} has no GPU ({torch.cuda.device_count()} visible)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return TensorParallel(dist.get_rank(), dist.get_world_size()), device


def exit_rank(code: int):
    """Leave a torchrun rank with `code` once its work is done and its group destroyed, skipping the interpreter's
    finalization: there gloo's worker threads can still release tensors whose Python references need an interpreter
    being torn down, and the rank aborts ("terminate called without an active exception", SIGABRT, no Python frame)
    after a successful run, about 1 width-2 run in 25 on a loaded 2-core machine (the mechanism is the one
    pytorch/pytorch#179291 describes). Output is flushed first; result files are already closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _take_rows(lin: torch.nn.Linear, rows: slice | torch.Tensor) -> None:
    """Keep the output rows `rows` of a linear layer (weight and bias), as fresh tensors."""
    lin.weight = torch.nn.Parameter(lin.weight.data[rows].clone(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = torch.nn.Parameter(lin.bias.data[rows].clone(), requires_grad=False)


def _take_columns(lin: torch.nn.Linear, cols: slice | torch.Tensor, rank: int) -> None:
    """Row-parallel: keep the input columns `cols`; the bias stays on rank 0, so the all-reduce adds it once."""
    lin.weight = torch.nn.Parameter(lin.weight.data[:, cols].contiguous(), requires_grad=False)
    if lin.bias is not None and rank != 0:
        lin.bias = None


def _split(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous share [lo, hi) of n items, as even as possible (the first n % world ranks get one more)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def head_ranges(cfg, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rank's query heads and KV heads, [lo, hi) each. Whole GQA groups go to a rank (unevenly where the KV
    heads do not divide by the width, e.g. SmolLM2's 3 at width 2); with fewer KV heads than ranks, each KV head
    is replicated on world / KVH ranks that split its group's query heads."""
    G = cfg.num_heads // cfg.num_kv_heads
    if cfg.num_kv_heads >= world:
        kv_lo, kv_hi = _split(cfg.num_kv_heads, world, rank)
        return (kv_lo * G, kv_hi * G), (kv_lo, kv_hi)
    reps = world // cfg.num_kv_heads
    kv, part = divmod(rank, reps)
    return (kv * G + part * (G // reps), kv * G + (part + 1) * (G // reps)), (kv, kv + 1)


def check_fits(cfg, world: int) -> None:
    """One clear error for a width the model's shapes cannot be split into."""
    if world < 1:
        raise EngineError(f"tensor-parallel width must be >= 1, got {world}")
    kvh, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    if kvh < world and (world % kvh or G % (world // kvh)):
        raise EngineError(f"tensor-parallel width {world} does not fit the model: {kvh} KV heads with {G} query "
                          f"heads each can be split over at most {kvh} ranks, or replicated over a multiple of "
                          f"{kvh} ranks whose count divides {G}")
    if cfg.intermediate_size < world:
        raise EngineError(f"tensor-parallel width {world} exceeds the MLP width {cfg.intermediate_size}")
    key_heads = getattr(cfg, "linear_num_key_heads", 0)
    if key_heads and key_heads % world:
        raise EngineError(f"tensor-parallel width {world} does not fit the model's Gated DeltaNet layers: their "
                          f"{key_heads} key heads must divide evenly over the ranks")


def _q_rows(a, q_lo: int, q_hi: int) -> torch.Tensor:
    """q_proj's rows for query heads [q_lo, q_hi). A gated q_proj also holds a gate per head: interleaved per head
    ([query | gate] of head 0, then of head 1, ...) as loaded, or all queries then all gates once Attention.fuse has
    regrouped them. Either way a head's query and gate go to the same rank, in the layout the module is in."""
    D = a.head_dim
    if not a.output_gate:
        return torch.arange(q_lo * D, q_hi * D)
    if getattr(a, "gate_rows_grouped", False):
        queries = torch.arange(q_lo * D, q_hi * D)
        return torch.cat((queries, queries + a.num_heads * D))
    return torch.arange(2 * q_lo * D, 2 * q_hi * D)


def shard_attention(a, cfg, tp: TensorParallel) -> None:
    """Column-parallel q/k/v by the rank's heads (head_ranges), row-parallel o_proj."""
    D = a.head_dim
    (q_lo, q_hi), (kv_lo, kv_hi) = head_ranges(cfg, tp.world, tp.rank)
    _take_rows(a.q_proj, _q_rows(a, q_lo, q_hi))
    _take_rows(a.k_proj, slice(kv_lo * D, kv_hi * D))
    _take_rows(a.v_proj, slice(kv_lo * D, kv_hi * D))
    _take_columns(a.o_proj, slice(q_lo * D, q_hi * D), tp.rank)
    a.num_heads, a.num_kv_heads = q_hi - q_lo, kv_hi - kv_lo
    a.tp = tp


def shard_mlp(m, cfg, tp: TensorParallel) -> None:
    """Column-parallel gate/up, row-parallel down."""
    inner = slice(*_split(cfg.intermediate_size, tp.world, tp.rank))
    _take_rows(m.gate_proj, inner)
    _take_rows(m.up_proj, inner)
    _take_columns(m.down_proj, inner, tp.rank)
    m.tp = tp


def shard_gated_delta(m, tp: TensorParallel) -> None:
    """Rank tp.rank's key heads [r K/W, (r+1) K/W) and the value heads they serve (consecutive, value_heads /
    key_heads per key head), so the recurrence needs no communication until out_proj's all-reduce."""
    K, V = m.key_heads // tp.world, m.value_heads // tp.world
    dk, dv = m.key_dim, m.value_dim
    keys = torch.arange(tp.rank * K * dk, (tp.rank + 1) * K * dk)
    values = torch.arange(tp.rank * V * dv, (tp.rank + 1) * V * dv)
    heads = slice(tp.rank * V, (tp.rank + 1) * V)
    # in_proj_qkv's rows and the conv's channels are [q | k | v] over all heads: the rank's slice of each part
    channels = torch.cat((keys, keys + m.key_heads * dk, values + 2 * m.key_heads * dk))
    _take_rows(m.in_proj_qkv, channels)
    _take_rows(m.in_proj_z, values)
    _take_rows(m.in_proj_b, heads)
    _take_rows(m.in_proj_a, heads)
    m.conv1d.weight = torch.nn.Parameter(m.conv1d.weight.data[channels].clone(), requires_grad=False)
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = len(channels)
    m.dt_bias = torch.nn.Parameter(m.dt_bias.data[heads].clone(), requires_grad=False)
    m.A_log = torch.nn.Parameter(m.A_log.data[heads].clone(), requires_grad=False)
    _take_columns(m.out_proj, values, tp.rank)  # the norm works per value head: its weight stays whole
    m.key_heads, m.value_heads = K, V
    m.split = (K * dk, K * dk, V * dv)
    m.tp = tp


def shard_draft(draft, tp: TensorParallel) -> None:
    """Shard a DFlash draft's layers in place for rank tp.rank of tp.world, before the drafter fuses their
    projections (engine.draft.DFlashDrafter): the draft's cache then holds the rank's KV heads."""
    cfg = draft.dcfg.layers
    try:
        check_fits(cfg, tp.world)
    except EngineError as e:
        raise EngineError(f"the draft cannot be sharded: {e}; leave ENGINE_SHARD_DRAFT unset to replicate it") from None
    for block in draft.layers:
        shard_mlp(block.mlp, cfg, tp)
        shard_attention(block.self_attn, cfg, tp)


def shard_draft_wanted() -> bool:
    """ENGINE_SHARD_DRAFT=1: shard DFlash drafts under tensor parallelism; 0, unset or auto: replicate them (the
    measured default; sharding adds two collectives per draft layer, which a small draft may not repay)."""
    return env_switch("ENGINE_SHARD_DRAFT") is True


def shard_target(model, tp: TensorParallel) -> None:
    """Shard a loaded (full) Transformer in place for rank tp.rank of tp.world."""
    from .model import fuse_projections

    if model.norms_folded:
        raise EngineError("shard the target before decoding with it: a decoder has folded its norms into its weights "
                          "(Transformer.fold_norms)")
    cfg, W, r = model.cfg, tp.world, tp.rank
    check_fits(cfg, W)
    for block in model.layers:
        shard_mlp(block.mlp, cfg, tp)
        if hasattr(block, "linear_attn"):
            shard_gated_delta(block.linear_attn, tp)
        else:
            shard_attention(block.self_attn, cfg, tp)
    fuse_projections(model.layers)
    # vocabulary-parallel embedding and LM head, padded with zero rows to a multiple of the width
    per_rank = -(-cfg.vocab_size // W)
    lo, hi = r * per_rank, min((r + 1) * per_rank, cfg.vocab_size)
    tied = model.lm_head.weight is model.embed_tokens.weight

    def vocab_slice(weight):
        part = torch.zeros(per_rank, weight.shape[1], dtype=weight.dtype, device=weight.device)
        part[:max(0, hi - lo)] = weight.data[lo:hi]
        return torch.nn.Parameter(part, requires_grad=False)

    model.embed_tokens.weight = vocab_slice(model.embed_tokens.weight)
    model.lm_head.weight = model.embed_tokens.weight if tied else vocab_slice(model.lm_head.weight)
    model.vocab_start, model.vocab_per_rank = lo, per_rank
    kv_lo, kv_hi = head_ranges(cfg, W, r)[1]
    model.num_kv_heads = kv_hi - kv_lo
    model.tp = tp
    tp.enable_one_shot(model.embed_tokens.weight.device, model.embed_tokens.weight.dtype)
    tp.enable_fused_norm(model.embed_tokens.weight.device, model.embed_tokens.weight.dtype, cfg.hidden_size)
    for block in model.layers:  # the skinny path's norms run inside its GEMMs: those blocks all-reduce at once
        if not block.skinny:
            block.mlp.defer_reduce = True
            if hasattr(block, "self_attn"):  # a Gated DeltaNet layer all-reduces its output itself
                block.self_attn.defer_reduce = True
