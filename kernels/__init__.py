"""Triton kernels of the engine's GPU path, each beside a plain PyTorch reference of the same function.

- tree_attention: queries are a draft tree's nodes, keys the committed cache plus the nodes, an ancestor mask
  decides visibility (split along the keys for long contexts);
- topk: the top-k tokens and log-probabilities of each draft depth (the tree builder's input);
- tree_ops: best-first tree build, the walk, and KV-cache compaction for all layers in one launch;
- fused: RMSNorm + residual add, q/k RMSNorm + RoPE + KV-cache store, SiLU(gate) * up.
- skinny_linear: a projection with its RMSNorm (and residual add) in the prologue and SiLU(gate) * up in the
  epilogue, batch-invariant, for launch-bound models (SmolLM2-135M's width).
- cross_entropy: per-row cross-entropy and argmax over the vocabulary, with its gradient (draft training's loss).
- argmax: the greedy token of each logits row in one launch, the vocabulary split over programs (the decode loop's
  torch.argmax(-1), which reads a row with one thread block).
- verify_rows: a verify pass's inputs (ids, embeddings, rotary rows, cache slots, visible lists) in one launch.
- int8_linear: a weight-only int8 GEMM with a scale per output row (a draft's weights, `--draft-weights int8`).

Each public function dispatches to its Triton kernel for CUDA tensors and to the reference otherwise;
ENGINE_DISABLE_TRITON=1 forces the references everywhere.

Programmatic dependent launch (`pdl_launch`): on Hopper and newer, the kernels of a decode step (skinny_linear,
the fused norms, tree attention) are launched so that each may start while the kernel before it finishes, and
wait for it (griddepcontrol.wait) before touching memory that kernel writes; skinny_linear prefetches its weight
into L2 meanwhile. A launch-bound step (a narrow model: about 200 kernels a step) costs about a microsecond less
per kernel (docs/design.md, "Programmatic dependent launch"). ENGINE_PDL=0 turns it off (A/B runs).
"""

import functools
import os

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (a CPU-only platform without wheels): the references are the only path
    triton = None
    tl = None

try:  # grid dependency control (Triton >= 3.3): griddepcontrol.wait / .launch_dependents
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_wait = gdc_launch_dependents = None


def triton_disabled() -> bool:
    """ENGINE_DISABLE_TRITON=1 (read at each call) makes every dispatcher use its PyTorch reference."""
    return os.environ.get("ENGINE_DISABLE_TRITON", "0").strip().lower() not in ("", "0", "false", "no")


def env_switch(name: str) -> bool | None:
    """An A/B switch of the environment: 1 or 0 -> True or False; unset or "auto" -> None (the default rule).
    Anything else is a ValueError naming the variable."""
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "", "0", "1"):
        raise ValueError(f"{name} must be 0, 1 or auto, got {os.environ[name]!r}")
    return None if value in ("auto", "") else value == "1"


@functools.cache
def _pdl_device(index: int) -> bool:
    """An NVIDIA device whose launches take the programmatic-serialization attribute (compute capability >= 9.0),
    with a Triton that can launch that way. ROCm devices (also "cuda" to torch) and older Tritons launch plainly."""
    import torch
    if torch.version.hip is not None or gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return (torch.cuda.get_device_capability(index)[0] >= 9
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


def pdl_launch(t) -> bool:
    """Whether kernels on t's device use programmatic dependent launch (module docstring). Read at each launch, so
    ENGINE_PDL applies to graphs captured after it is set."""
    if triton is None or not t.is_cuda or env_switch("ENGINE_PDL") is False:
        return False
    return _pdl_device(t.device.index if t.device.index is not None else 0)


def pdl_options(pdl: bool) -> dict:
    """The launch keyword of a kernel whose PDL constexpr is `pdl`."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """A PDL-launched kernel's first step before it reads or writes memory another kernel touches: wait until the
        kernel before it has finished (its writes visible), then let the next kernel launch. Every kernel launched
        with PDL must call it, so that completion stays transitive along the stream."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(addr, nbytes):
        """cp.async.bulk.prefetch.L2 of `nbytes` (a multiple of 16; 0 issues nothing) at each 16-byte aligned
        address in `addr`: a hint, legal before pdl_wait (L2 is where the kernel before it writes)."""
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }"
                                  "\n\tmov.u32 $0, 0;", "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
else:
    pdl_wait = prefetch_l2 = None


def bulk_prefetch_ok(t, row_stride: int, row_len: int) -> bool:
    """Whether prefetch_l2 can take rows of `row_len` elements `row_stride` apart from t's data: 16-byte aligned
    and a multiple of 16 bytes long."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and (row_stride * size) % 16 == 0 and (row_len * size) % 16 == 0


_COUNTERS: dict = {}  # device -> the arrival counters of the kernels that merge their programs' partials
_RETIRED: list = []   # outgrown counters, kept alive: a captured graph may still use them


def arrival_counters(n: int, device):
    """At least n zeroed int32 arrival counters on `device`, shared by every kernel whose last program to arrive
    merges the others' partials (tree_attention's key splits, argmax's vocabulary chunks): each call's last
    arriver resets its counter to 0, and calls on one stream run one after another (a kernel launched with PDL
    counts only after the kernel before it has finished). Allocate before a graph capture (the engine's eager
    warm-up round does): zeros allocated during one would be filled only when the graph replays."""
    import torch
    key = torch.device(device)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < n:
        if have is not None:
            _RETIRED.append(have)
        have = _COUNTERS[key] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return have


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes."""
    return 1 << max(0, (n - 1).bit_length())


def row_values(value, rows: int, name: str = "start") -> list[int]:
    """A per-sequence argument of a reference, on the host: an int or a 1-element tensor (every row the same), or
    one value per batch row (batched decoding: rows that are separate sequences)."""
    if hasattr(value, "numel") and value.numel() > 1:
        if value.numel() != rows:
            raise ValueError(f"{name} has {value.numel()} values for a batch of {rows}")
        return [int(x) for x in value.reshape(-1).tolist()]
    return [int(value)] * rows
