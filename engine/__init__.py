"""A lossless speculative-decoding engine: greedy AR, DFlash and DDTree decoding on the engine's own model code."""
import os
import warnings

# Batch-invariant GEMMs: without cuBLAS's split-K workspace, a row of a skinny GEMM is computed the same way
# whatever the number of rows (checked on an H200 for 1 to 80 rows at 8B and 135M shapes), so a verify pass
# reproduces the one-token decode step bit for bit. Set before torch creates its cuBLAS handles; a user's own
# setting wins.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")
os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "0")

# torch.cuda imports pynvml, which warns that the package was renamed; the project depends on it on purpose.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)


def _check_kernels_package() -> None:
    """This project's `kernels` package shares its top-level name with Hugging Face's `kernels` distribution, which
    transformers >= 5.25 requires and imports: with both installed, one of the two is shadowed. Say so plainly
    instead of failing later inside an import."""
    import importlib.metadata
    from pathlib import Path

    import kernels

    ours = Path(__file__).resolve().parent.parent / "kernels"
    if Path(kernels.__file__).resolve().parent != ours:
        raise ImportError(f"`import kernels` found {Path(kernels.__file__).parent}, not this project's {ours}: "
                          "Hugging Face's `kernels` package shadows it; pip uninstall kernels (and keep transformers "
                          "< 5.25)")
    try:
        hf_kernels = importlib.metadata.version("kernels")
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return
    if tuple(int(p) for p in transformers.split(".")[:2] if p.isdecimal()) >= (5, 25):
        raise ImportError(f"transformers {transformers} imports Hugging Face's `kernels` {hf_kernels}, whose name this "
                          "project's `kernels` package shadows: pip install 'transformers>=4.56,<5.25' (pyproject.toml)")


_check_kernels_package()

from .decode import METHODS, DecodeSettings, Decoder, GenerationResult  # noqa: E402
from .draft import DFlashDrafter, DraftInput, Drafter  # noqa: E402
from .errors import EngineError  # noqa: E402
from .loading import DEFAULT_TARGET, Target, load_drafter, load_target  # noqa: E402
from .oracle import OracleDrafter  # noqa: E402

__all__ = ["METHODS", "DecodeSettings", "Decoder", "GenerationResult", "DFlashDrafter", "DraftInput", "Drafter",
           "EngineError", "DEFAULT_TARGET", "Target", "load_drafter", "load_target", "OracleDrafter"]
