"""Names of the IR attributes one stage writes and a later stage (in another layer) reads."""

# on each bucket function (relax_passes/bucket_dispatch.py): {dim: [lo, hi, tune_at]}; read by
# task extraction (schedules/tasks.py), the library rewrites and the reports
BUCKET_ATTR = "relaxtune.bucket"

# on the block of a kernel that dequantizes a weight as it reads it (relaxtune/kernels/quant_tir.py): the
# weight format's name (kernels/quant_formats.py); read by the quantized kernels' rules (schedules/rules)
DEQUANTIZE_ATTR = "relaxtune.dequantize"
# on a kernel's block that converts a quantized weight's float16 scales (or mins) to float32 before the
# dequantization reads them (kernels/quant_tir.py); the GEMV rule converts a tile's scales as one vector
DEQUANTIZE_SCALE_ATTR = "relaxtune.dequantize_scale"

# on the block of a kernel that dequantizes a 4-bit weight kept in the GPU layout (relaxtune/kernels/quant_gpu_tir.py,
# written by relax_passes/pack_quant_weights_cuda.py); read by relax_passes/quant_gemv_cuda.py
GPU_Q4_ATTR = "relaxtune.q4_gpu_layout"
