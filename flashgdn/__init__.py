"""flashgdn: Hopper kernels for the gated delta rule (chunked prefill), with an exact PyTorch reference."""
__version__ = "0.1.0.dev0"
