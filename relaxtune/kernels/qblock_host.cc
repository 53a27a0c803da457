// The host side of the whole decoder layer's decode step in one kernel (relaxtune_q4block_i8: qmlp_stream.cu with its
// q/k/v step), appended after qmlp_host.cc in one object (kernels/gemv.py), whose LaunchQ4Mlp it calls.

namespace {
// the whole decoder layer's step: q, k and v too, from x (Q4MlpFirst), into qkv (1, 1, heads, D), which the
// attention reads as q, k and v (heads: their first heads; FuseQuantBlockCuda): attn's q, k and v are all qkv, as the
// kernel's tagged forms, which read them from their copy in shared memory, rely on
// (relaxtune_q4block_i8_trace: with the stamps of LaunchQ4Mlp's `trace`, benchmarks/q4block_trace.py)
void LaunchQ4Block(const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& gin, const tvm::ffi::TensorView& wqkv,
                   const tvm::ffi::TensorView& sqkv, double eps_in, const tvm::ffi::TensorView& cos,
                   const tvm::ffi::TensorView& sin, const tvm::ffi::Shape& heads, int64_t causal, double scale,
                   int64_t rope, const tvm::ffi::TensorView& res, const tvm::ffi::TensorView& wo,
                   const tvm::ffi::TensorView& so, const tvm::ffi::TensorView& g, const tvm::ffi::TensorView& wgu,
                   const tvm::ffi::TensorView& sgu, const tvm::ffi::TensorView& wd, const tvm::ffi::TensorView& sd,
                   double eps, const tvm::ffi::TensorView& qkv, const tvm::ffi::TensorView& h,
                   const tvm::ffi::TensorView& act, const tvm::ffi::TensorView& y,
                   const tvm::ffi::TensorView* trace = nullptr) {
  TVM_FFI_ICHECK(wo.ndim() == 2) << "q4block: the o_proj weight must be (H, A / 8)";
  int64_t rows = 0;
  const AttnParams a = CheckAttention("q4block", qkv, qkv, qkv, cos, sin, heads, causal, scale, rope, wo.size(1) * 8,
                                      1, res.dtype(), &rows);
  const Q4MlpFirst first{&x, &gin, &wqkv, &sqkv, &qkv, eps_in};
  LaunchQ4Mlp(nullptr, res, wo, so, g, wgu, sgu, wd, sd, eps, h, act, y, nullptr, trace, &a, &first);
}
void Q4BlockI8(tvm::ffi::TensorView x, tvm::ffi::TensorView gin, tvm::ffi::TensorView wqkv, tvm::ffi::TensorView sqkv,
               double eps_in, tvm::ffi::TensorView cos, tvm::ffi::TensorView sin, tvm::ffi::Shape heads, int64_t causal,
               double scale, int64_t rope, tvm::ffi::TensorView res, tvm::ffi::TensorView wo, tvm::ffi::TensorView so,
               tvm::ffi::TensorView g, tvm::ffi::TensorView wgu, tvm::ffi::TensorView sgu, tvm::ffi::TensorView wd,
               tvm::ffi::TensorView sd, double eps, tvm::ffi::TensorView qkv, tvm::ffi::TensorView h,
               tvm::ffi::TensorView act, tvm::ffi::TensorView y) {
  LaunchQ4Block(x, gin, wqkv, sqkv, eps_in, cos, sin, heads, causal, scale, rope, res, wo, so, g, wgu, sgu, wd, sd, eps,
                qkv, h, act, y);
}
void Q4BlockI8Trace(tvm::ffi::TensorView x, tvm::ffi::TensorView gin, tvm::ffi::TensorView wqkv,
                    tvm::ffi::TensorView sqkv, double eps_in, tvm::ffi::TensorView cos, tvm::ffi::TensorView sin,
                    tvm::ffi::Shape heads, int64_t causal, double scale, int64_t rope, tvm::ffi::TensorView res,
                    tvm::ffi::TensorView wo, tvm::ffi::TensorView so, tvm::ffi::TensorView g,
                    tvm::ffi::TensorView wgu, tvm::ffi::TensorView sgu, tvm::ffi::TensorView wd,
                    tvm::ffi::TensorView sd, double eps, tvm::ffi::TensorView qkv, tvm::ffi::TensorView h,
                    tvm::ffi::TensorView act, tvm::ffi::TensorView y, tvm::ffi::TensorView trace) {
  LaunchQ4Block(x, gin, wqkv, sqkv, eps_in, cos, sin, heads, causal, scale, rope, res, wo, so, g, wgu, sgu, wd, sd, eps,
                qkv, h, act, y, &trace);
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4block_i8, Q4BlockI8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4block_i8_trace, Q4BlockI8Trace);
