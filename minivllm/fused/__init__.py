"""Chapter 9's fused token-wise ops, beside attention/ and built the same way: the forward pass
that calls them (forward.py, read it against model.py) and their Triton kernels (kernels.py),
imported only when `fused_ops=True` asks for them."""
from minivllm.fused.forward import (
    check_fused_ops,
    fused_forward,
    merge_projections,
    rope_cos_sin_table,
)

__all__ = ["check_fused_ops", "fused_forward", "merge_projections", "rope_cos_sin_table"]
