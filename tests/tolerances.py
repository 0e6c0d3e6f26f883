"""The one tolerance table of the test suite (relative errors unless noted)."""

#: fast path vs its reference twin, float32 (oracle chain: chunked = quadratic = recurrent)
ORACLE_FP32 = 1e-5
#: hybrid with window >= N vs exact softmax, float32
SOFTMAX_FP32 = 1e-5
#: gradients of the fast path vs the reference twin, float32 (relative RMS)
GRAD_FP32 = 1e-4
#: bf16/fp16 inputs vs the fp32 computation (relative, dominated by input rounding)
LOW_PRECISION = 3e-2
#: converted model with window >= N vs the original model (absolute, logits)
PLUMBING_LOGITS = 1e-4
#: state-cache decoding (prefill + chunks + single tokens) vs one full forward (absolute, logits)
DECODE_LOGITS = 1e-4
#: 2-process vs 1-process training losses with the same global batch (relative; gloo all-reduce order)
DDP_LOSS_REL = 1e-5
#: resumed vs uninterrupted run, same process count (relative; observed bit-identical)
RESUME_LOSS_REL = 1e-6
#: FSDP2 (sharded) vs the same model unsharded, per step (relative)
FSDP_LOSS_REL = 1e-5
#: gradients (inputs and feature-map parameters) of the op vs the reference twin, float64 (relative;
#: observed <= 1e-12, including rows on a signed map's eps floor)
GRAD_FP64 = 1e-8
#: a CUDA path in bf16 vs the CPU fp32 computation on the same rounded inputs (relative; the goal
#: of the GPU backends: FlexAttention's probabilities meet the values in bf16)
GPU_BF16 = 1e-2
#: fla-core's Triton kernels vs the fp32 twin (relative): ``tl.dot`` multiplies float32 in TF32
#: (10-bit mantissa) by default, ~1e-3 per product
TF32_KERNEL = 2e-3
