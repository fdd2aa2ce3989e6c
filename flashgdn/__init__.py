"""flashgdn: Hopper kernels for the gated delta rule (chunked prefill), with an exact PyTorch reference."""
__version__ = "0.1.0.dev0"

from .api.op import chunk_gated_delta_rule
from .precompile import preload

__all__ = ["chunk_gated_delta_rule", "preload", "__version__"]
