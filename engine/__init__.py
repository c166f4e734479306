"""A lossless speculative-decoding engine: greedy AR, DFlash and DDTree decoding on the engine's own model code."""
import warnings

# torch.cuda imports pynvml, which warns that the package was renamed; the project depends on it on purpose.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)

from .decode import METHODS, DecodeSettings, Decoder, GenerationResult  # noqa: E402
from .draft import DFlashDrafter, DraftInput, Drafter  # noqa: E402
from .errors import EngineError  # noqa: E402
from .loading import DEFAULT_TARGET, Target, load_drafter, load_target  # noqa: E402
from .oracle import OracleDrafter  # noqa: E402

__all__ = ["METHODS", "DecodeSettings", "Decoder", "GenerationResult", "DFlashDrafter", "DraftInput", "Drafter",
           "EngineError", "DEFAULT_TARGET", "Target", "load_drafter", "load_target", "OracleDrafter"]
