"""Inference backends of the causal scan: the PyTorch inference form (:mod:`.causal_infer`), the
opt-in ``torch.compile`` kernels (:mod:`.kernels`) and the compiled C++ CPU kernel (:mod:`.native`)."""
