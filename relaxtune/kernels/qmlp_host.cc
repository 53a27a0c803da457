// The host side of the 4-bit decode MLP kernel (qmlp_stream.cu), appended after qgemv_host.cc in one object
// (kernels/gemv.py): its checks, then one cooperative launch (every block resident, which the kernel's grid barrier
// needs) on TVM's current stream, a programmatic dependent one on compute capability 9.0+ unless RELAXTUNE_GEMV_PDL=0,
// with no allocation: CUDA graphs capture it.
// relaxtune_q4mlp_i8(x, res, wo, so, g, wgu, sgu, wd, sd, eps, h, act, y): one row, fp16, int8 activations;
// relaxtune_q4mlp_attn_i8(q, k, v, cos, sin, heads, causal, scale, rope, res, ...) computes x, the attention of the
// row, in every block; relaxtune_q4block_i8(x, gin, wqkv, sqkv, eps_in, cos, sin, heads, causal, scale, rope, res, ...,
// qkv, h, act, y) computes q, k and v too (qkv = rms_norm(x, gin, eps_in) @ Wqkv^T, the whole decoder layer;
// qblock_host.cc);
// relaxtune_q4mlp_i8_kernel(...) names the kernel it would launch, or says why none applies (for tests);
// relaxtune_q4mlp_i8_trace(..., trace) launches it with a globaltimer stamp per block and event in trace (int64,
// blocks x 20: benchmarks/q4mlp_trace.py). For measurements, read per launch: RELAXTUNE_Q4MLP=NAME picks the kernel,
// RELAXTUNE_Q4MLP_STAGES=N sets its ring's slots (as far as they fit), RELAXTUNE_Q4MLP_AHEAD=N how far its producer
// runs ahead of a grid barrier, RELAXTUNE_Q4MLP_BARRIER=generation takes the other grid barrier (=tagged: none, the
// step's outputs as tagged words; =claimed: those, with each step's tiles claimed by the blocks),
// RELAXTUNE_Q4MLP_COOPERATIVE=0 launches it as a programmatic dependent only (Q4MlpCooperative);
// relaxtune_q4mlp_i8_launch() says which launch attributes the launches so far took.

#include <atomic>

namespace {
constexpr int kCooperative = 2;  // CU_LAUNCH_ATTRIBUTE_COOPERATIVE

struct Q4MlpArgs {  // must match qmlp_stream.cu's Q4MlpParams
  const void *x, *res, *wo, *so, *g, *wgu, *sgu, *wd, *sd;
  void *h, *act, *y;
  int a, hidden, f, shift_o, shift_gu, shift_d;
  float eps;
  int stages, stage_bytes;
  void* trace;
  int barrier;  // qmlp_grid.cu's kGenerationBarrier / kCountBarrier / kTaggedWords
  int x_bytes;  // > 0: x is the attention of the row (attn), in that much shared memory
  int ahead;    // slots of a step copied before its grid barrier (Q4MlpAhead)
  AttnParams attn;
  const void *wqkv, *sqkv, *gin;  // the q/k/v step (Q4MlpFirst), or null
  void* qkv;
  int nqkv, shift_qkv;
  float eps_in;
  int tag_bytes;  // with tagged words (kTaggedWords, kClaimedTiles): shared memory for h and act as read back
};
struct Q4MlpKernel {
  const char* name;
  int groups, rows_h, pieces_h, rows_f, pieces_f;  // GR, RH, PH, RF, PF of qmlp_stream.cu
};
// the first that applies, or RELAXTUNE_Q4MLP's
constexpr Q4MlpKernel kQ4MlpKernels[] = {{"relaxtune_q4mlp_h1f4", 2, 8, 1, 4, 4},
                                         {"relaxtune_q4mlp_h3f4", 2, 4, 3, 4, 4}};
std::atomic<bool> both_refused{false};  // the driver refused a cooperative programmatic launch: cooperative only
constexpr int kQ4MlpTraceEvents = 20;  // qmlp_stream.cu's stamps per block
constexpr int kQ4MlpWarps = 8, kQ4MlpScratch = 4 * kQ4MlpWarps;  // partial sums per row; the norm's per-warp sums

// qmlp_stream.cu's grid barrier: the count barrier where every launch's grid is the SM count (`whole`), unless
// RELAXTUNE_Q4MLP_BARRIER=generation, or =tagged for no barrier (qmlp_grid.cu's kTaggedWords), or =claimed for no
// barrier and tiles claimed (kClaimedTiles; read per launch)
constexpr int kQ4MlpTagged = 2, kQ4MlpClaimed = 3;
int Q4MlpBarrier(bool whole) {
  const char* value = std::getenv("RELAXTUNE_Q4MLP_BARRIER");
  const std::string asked = value != nullptr ? value : "";
  if (asked == "tagged") return kQ4MlpTagged;
  if (asked == "claimed") return kQ4MlpClaimed;
  return whole && asked != "generation" ? 1 : 0;
}

// the producer copies at most kQ4MlpAhead slots of gate / up and of down before the grid barrier that starts their
// step is passed: copies queued past that only slow the barrier's round trips and the read back of h or act
// (docs/results.md); RELAXTUNE_Q4MLP_AHEAD=N instead (read per launch, for measurements; N >= the ring: no limit)
constexpr int kQ4MlpAhead = 2;
// the ring's slots: more than 3 (4 fit at the 7B sizes) only queue more copies in front of the grid barriers' round
// trips (docs/results.md)
constexpr int kQ4MlpStages = 3;
// the ring's slots at most: past them, the full barriers' places hold each slot's claimed tile (qmlp_claim.cu's
// q4mlp_slot_tiles) and the count of barriers passed
constexpr int kQ4MlpMaxStages = kQ4MaxStages / 2;
static_assert(kQ4MlpStages <= kQ4MlpMaxStages, "the ring's slots");
int Q4MlpAhead(int stages) {
  const char* value = std::getenv("RELAXTUNE_Q4MLP_AHEAD");
  return std::min(value != nullptr && std::atoi(value) >= 0 ? std::atoi(value) : kQ4MlpAhead, stages);
}
// RELAXTUNE_Q4MLP_COOPERATIVE=0 (read per launch, for measurements): launched without the cooperative attribute,
// a programmatic dependent only; the grid barriers then rely on the SM-count grid's blocks all becoming resident
// (one per SM), which nothing else on the device may prevent
bool Q4MlpCooperative() {
  const char* value = std::getenv("RELAXTUNE_Q4MLP_COOPERATIVE");
  return value == nullptr || std::string(value) != "0";
}
std::string Q4MlpForced() {
  const char* value = std::getenv("RELAXTUNE_Q4MLP");
  return value != nullptr ? std::string(value) : std::string();
}

struct Q4MlpPlan {
  const Q4MlpKernel* kernel = nullptr;
  int blocks = 0, stages = 0, stage_bytes = 0, shared_bytes = 0;
  int barrier = 0, tag_bytes = 0;  // Q4MlpBarrier's for the grid; the tagged words' shared memory (0 without them)
  std::string why;  // why none applies, when kernel is null
};

// the rows of one slot (2 row groups x rows) of a weight with K columns: weights, then their scales
int64_t Q4MlpSlotBytes(int64_t k, int shift, int groups, int rows_per_group) {
  return groups * rows_per_group * (k / 2 + 2 * (k >> (5 + shift)));
}

// shifts: o, gate / up, down and q / k / v's groups; nqkv: the q/k/v step's rows (0: none); x_bytes: the shared
// memory of the attention's x
Q4MlpPlan PlanQ4Mlp(int64_t a, int64_t hidden, int64_t f, const int (&shifts)[4], int64_t nqkv, int major, int sms,
                    int shared, int x_bytes) {
  Q4MlpPlan plan;
  const int64_t ks[4] = {a, hidden, f, hidden};
  for (int i = 0; i < (nqkv > 0 ? 4 : 3); ++i) {
    if ((ks[i] >> (5 + shifts[i])) % 8 != 0) {
      plan.why = "K = " + std::to_string(ks[i]) + " is not a multiple of 8 groups";
      return plan;
    }
  }
  if (major < 9) {
    plan.why = "compute capability " + std::to_string(major) + ".x is below 9.0";
    return plan;
  }
  const std::string forced = Q4MlpForced();
  for (const Q4MlpKernel& kernel : kQ4MlpKernels) {
    if (!forced.empty() && forced != kernel.name) continue;
    if (std::max(a, hidden) <= 4096 * kernel.pieces_h && f <= 4096 * kernel.pieces_f) {
      plan.kernel = &kernel;
      break;
    }
  }
  if (plan.kernel == nullptr) {
    plan.why = "A, H <= " + std::to_string(4096 * 3) + " and F <= " + std::to_string(4096 * 4) + " only";
    return plan;
  }
  plan.blocks = static_cast<int>(std::min<int64_t>({sms, hidden, f}));
  plan.barrier = Q4MlpBarrier(plan.blocks == sms);
  if (plan.barrier >= kQ4MlpTagged && nqkv > 3 * 4096 * plan.kernel->pieces_h) {  // the tagged words' and their poll's
    plan.why = "q/k/v's " + std::to_string(nqkv) + " rows are over " +
               std::to_string(3 * 4096 * plan.kernel->pieces_h) + " (" + plan.kernel->name + " with tagged words)";
    plan.kernel = nullptr;
    return plan;
  }
  // tagged words: h, and act or q | k | v, as the block read them back, each rounded up to 128 bytes (qmlp_stream.cu's
  // staged_h, staged_a)
  const int64_t staged = (hidden + 63) / 64 + (std::max(f, nqkv) + 63) / 64;
  const int tag_bytes = plan.barrier >= kQ4MlpTagged ? static_cast<int>(staged * 128) : 0;
  const bool claimed = plan.barrier == kQ4MlpClaimed;
  const int64_t rows = (hidden + plan.blocks - 1) / plan.blocks, frows = (f + plan.blocks - 1) / plan.blocks;
  const int64_t qrows = (nqkv + plan.blocks - 1) / plan.blocks;
  const int gr = plan.kernel->groups;
  // the partial sums: of the block's rows, or with claimed tiles two tiles' of two segments; then the norm's
  const int64_t tile_rows = 4 * gr * std::max(plan.kernel->rows_h, plan.kernel->rows_f);
  const int64_t part = ((claimed ? tile_rows : std::max({rows, 2 * frows, qrows})) * kQ4MlpWarps + kQ4MlpScratch) * 4;
  const int64_t slot = std::max({Q4MlpSlotBytes(a, shifts[0], gr, plan.kernel->rows_h),
                                 Q4MlpSlotBytes(hidden, shifts[1], gr, plan.kernel->rows_h),
                                 Q4MlpSlotBytes(f, shifts[2], gr, plan.kernel->rows_f),
                                 nqkv > 0 ? Q4MlpSlotBytes(hidden, shifts[3], gr, plan.kernel->rows_h) : 0});
  // kQ4MlpStages slots, or RELAXTUNE_Q4MLP_STAGES (for measurements), as far as they fit
  const char* asked = std::getenv("RELAXTUNE_Q4MLP_STAGES");
  const int64_t want = asked != nullptr && std::atoi(asked) > 0 ? std::atoi(asked) : kQ4MlpStages;
  const int64_t fit = (shared - kQ4BarrierBytes - x_bytes - tag_bytes - part) / slot;
  const int64_t stages = std::min<int64_t>({want, kQ4MlpMaxStages, fit});
  if (stages < 2) {
    plan.kernel = nullptr;
    plan.why = "two ring slots of " + std::to_string(slot) + " bytes do not fit in shared memory";
    return plan;
  }
  plan.stages = static_cast<int>(stages), plan.stage_bytes = static_cast<int>(slot), plan.tag_bytes = tag_bytes;
  plan.shared_bytes = static_cast<int>(kQ4BarrierBytes + x_bytes + tag_bytes + stages * slot + part);
  return plan;
}

// the q/k/v step of relaxtune_q4block_i8: its input (x: H values), norm weight and epsilon, weight, output
struct Q4MlpFirst {
  const tvm::ffi::TensorView *x, *gin, *wqkv, *sqkv, *qkv;
  double eps;
};

// checks the operands, then launches (or, with `chosen`, puts the kernel's name or why none applies there)
// x: the o_proj input, or null with `attn`: x is the attention of the row (CheckAttention), computed by each block;
// `first`: and q, k, v (attn's) the q/k/v step's output
void LaunchQ4Mlp(const tvm::ffi::TensorView* x, const tvm::ffi::TensorView& res, const tvm::ffi::TensorView& wo,
                 const tvm::ffi::TensorView& so, const tvm::ffi::TensorView& g, const tvm::ffi::TensorView& wgu,
                 const tvm::ffi::TensorView& sgu, const tvm::ffi::TensorView& wd, const tvm::ffi::TensorView& sd,
                 double eps, const tvm::ffi::TensorView& h, const tvm::ffi::TensorView& act,
                 const tvm::ffi::TensorView& y, std::string* chosen = nullptr,
                 const tvm::ffi::TensorView* trace = nullptr, const AttnParams* attn = nullptr,
                 const Q4MlpFirst* first = nullptr) {
  const Q4Weight o = CheckQ4Weight("q4mlp (o)", wo, so), gu = CheckQ4Weight("q4mlp (gate/up)", wgu, sgu);
  const Q4Weight d = CheckQ4Weight("q4mlp (down)", wd, sd);
  const int64_t hidden = o.n, f = d.k;
  TVM_FFI_ICHECK(gu.k == hidden && gu.n == 2 * f && d.n == hidden)
      << "q4mlp: gate/up must be (2F, H) and down (H, F) for o_proj (H = " << hidden << ", A), not (" << gu.n << ", "
      << gu.k << ") and (" << d.n << ", " << d.k << ")";
  Q4Weight qkv{0, hidden, 0};
  if (first != nullptr) {
    qkv = CheckQ4Weight("q4block (q/k/v)", *first->wqkv, *first->sqkv);
    TVM_FFI_ICHECK(qkv.k == hidden && first->qkv->numel() == qkv.n)
        << "q4block: q/k/v must be (N, H) for H = " << hidden << " with an N-value output, not (" << qkv.n << ", "
        << qkv.k << ") and " << first->qkv->numel();
  }
  const struct {
    const tvm::ffi::TensorView* t;
    int64_t n;
    const char* what;
  } vectors[] = {{x, o.k, "x"},
                 {&res, hidden, "res"},
                 {&g, hidden, "g"},
                 {&h, hidden, "h"},
                 {&act, f, "act"},
                 {&y, hidden, "y"},
                 {first != nullptr ? first->x : nullptr, hidden, "x (q/k/v's input)"},
                 {first != nullptr ? first->gin : nullptr, hidden, "gin (q/k/v's norm)"},
                 {first != nullptr ? first->qkv : nullptr, qkv.n, "qkv"}};
  for (const auto& v : vectors) {
    if (v.t == nullptr) continue;  // the attention's x
    TVM_FFI_ICHECK(IsHalf(v.t->dtype()) && v.t->numel() == v.n && v.t->IsContiguous())
        << "q4mlp: " << v.what << " must be one compact float16 row of " << v.n << " values";
    TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(Data(*v.t)) % 16 == 0)
        << "q4mlp: " << v.what << " must be 16-byte aligned";
  }
  for (const auto* t : {&wo, &so, &wgu, &sgu, &wd, &sd}) {
    TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(Data(*t)) % 16 == 0)
        << "q4mlp: the weights and scales must be 16-byte aligned";
  }
  Driver* drv = LoadDriver();
  DLDevice dev = y.device();
  const int major = Attribute(drv, dev.device_id, kComputeMajor), sms = Attribute(drv, dev.device_id, kMultiprocessors);
  const int shifts[4] = {o.shift, gu.shift, d.shift, qkv.shift};
  const int shared_limit = Attribute(drv, dev.device_id, kMaxSharedOptIn);
  const int x_bytes = attn != nullptr ? static_cast<int>((o.k * 2 + 127) / 128 * 128) : 0;
  const Q4MlpPlan plan = PlanQ4Mlp(o.k, hidden, f, shifts, qkv.n, major, sms, shared_limit, x_bytes);
  if (chosen != nullptr) {
    *chosen = plan.kernel != nullptr ? std::string(plan.kernel->name) : "none: " + plan.why;
    return;
  }
  TVM_FFI_ICHECK(plan.kernel != nullptr) << "q4mlp: the kernel does not apply: " << plan.why;
  TVM_FFI_ICHECK(drv->launch_ex != nullptr) << "q4mlp: a cooperative launch needs cuLaunchKernelEx (a CUDA 12+ driver)";
  Ptr fn = Kernel(drv, relaxtune_gemv_fatbin, dev.device_id, plan.kernel->name, shared_limit);
  Q4MlpArgs p{x != nullptr ? Data(*x) : first != nullptr ? Data(*first->x) : nullptr,
              Data(res), Data(wo), Data(so), Data(g),
              Data(wgu), Data(sgu), Data(wd), Data(sd), Data(h),
              Data(act), Data(y),   static_cast<int>(o.k), static_cast<int>(hidden), static_cast<int>(f),
              o.shift,   gu.shift,  d.shift,  static_cast<float>(eps), plan.stages, plan.stage_bytes, nullptr,
              plan.barrier, x_bytes, Q4MlpAhead(plan.stages),
              attn != nullptr ? *attn : AttnParams{}};
  if (first != nullptr) {
    p.wqkv = Data(*first->wqkv), p.sqkv = Data(*first->sqkv), p.gin = Data(*first->gin), p.qkv = Data(*first->qkv);
    p.nqkv = static_cast<int>(qkv.n), p.shift_qkv = qkv.shift, p.eps_in = static_cast<float>(first->eps);
  }
  p.tag_bytes = plan.tag_bytes;
  if (trace != nullptr) {
    TVM_FFI_ICHECK(trace->dtype().code == kDLInt && trace->dtype().bits == 64 && trace->IsContiguous() &&
                   trace->numel() >= kQ4MlpTraceEvents * plan.blocks)
        << "q4mlp: the trace must be compact int64 of at least " << kQ4MlpTraceEvents * plan.blocks << " values";
    p.trace = Data(*trace);
  }
  void* args[] = {&p};
  // cooperative, and a programmatic dependent where the driver takes both (else from then on cooperative only)
  LaunchAttribute attrs[2]{};
  attrs[0].id = kCooperative, attrs[0].value.cluster.x = 1;
  attrs[1].id = kProgrammaticSerialization, attrs[1].value.cluster.x = 1;
  const bool pdl = ProgrammaticLaunch() && !both_refused.load();
  const unsigned threads = static_cast<unsigned>(plan.kernel->groups * kQ4PieceThreads + 32);
  LaunchConfig config{static_cast<unsigned>(plan.blocks), 1, 1, threads, 1, 1,
                      static_cast<unsigned>(plan.shared_bytes), TVMFFIEnvGetStream(dev.device_type, dev.device_id),
                      attrs, pdl ? 2u : 1u};
  if (!Q4MlpCooperative() && plan.blocks == sms) {
    config.attrs = attrs + 1, config.num_attrs = ProgrammaticLaunch() ? 1u : 0u;
    Check(drv, drv->launch_ex(&config, fn, args, nullptr), "cuLaunchKernelEx (programmatic)");
    return;
  }
  if (pdl && drv->launch_ex(&config, fn, args, nullptr) == 0) return;
  if (pdl) both_refused = true, config.num_attrs = 1;
  Check(drv, drv->launch_ex(&config, fn, args, nullptr), "cuLaunchKernelEx (cooperative)");
}

void Q4MlpI8(tvm::ffi::TensorView x, tvm::ffi::TensorView res, tvm::ffi::TensorView wo, tvm::ffi::TensorView so,
             tvm::ffi::TensorView g, tvm::ffi::TensorView wgu, tvm::ffi::TensorView sgu, tvm::ffi::TensorView wd,
             tvm::ffi::TensorView sd, double eps, tvm::ffi::TensorView h, tvm::ffi::TensorView act,
             tvm::ffi::TensorView y) {
  LaunchQ4Mlp(&x, res, wo, so, g, wgu, sgu, wd, sd, eps, h, act, y);
}
std::string Q4MlpI8Kernel(tvm::ffi::TensorView x, tvm::ffi::TensorView res, tvm::ffi::TensorView wo,
                          tvm::ffi::TensorView so, tvm::ffi::TensorView g, tvm::ffi::TensorView wgu,
                          tvm::ffi::TensorView sgu, tvm::ffi::TensorView wd, tvm::ffi::TensorView sd, double eps,
                          tvm::ffi::TensorView h, tvm::ffi::TensorView act, tvm::ffi::TensorView y) {
  std::string chosen;
  LaunchQ4Mlp(&x, res, wo, so, g, wgu, sgu, wd, sd, eps, h, act, y, &chosen);
  return chosen;
}
void Q4MlpI8Trace(tvm::ffi::TensorView x, tvm::ffi::TensorView res, tvm::ffi::TensorView wo, tvm::ffi::TensorView so,
                  tvm::ffi::TensorView g, tvm::ffi::TensorView wgu, tvm::ffi::TensorView sgu, tvm::ffi::TensorView wd,
                  tvm::ffi::TensorView sd, double eps, tvm::ffi::TensorView h, tvm::ffi::TensorView act,
                  tvm::ffi::TensorView y, tvm::ffi::TensorView trace) {
  LaunchQ4Mlp(&x, res, wo, so, g, wgu, sgu, wd, sd, eps, h, act, y, nullptr, &trace);
}
// the same with x the attention of the step's one row (FuseQuantMlpCuda where the flash call feeds o_proj)
void Q4MlpAttnI8(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v, tvm::ffi::TensorView cos,
                 tvm::ffi::TensorView sin, tvm::ffi::Shape heads, int64_t causal, double scale, int64_t rope,
                 tvm::ffi::TensorView res, tvm::ffi::TensorView wo, tvm::ffi::TensorView so, tvm::ffi::TensorView g,
                 tvm::ffi::TensorView wgu, tvm::ffi::TensorView sgu, tvm::ffi::TensorView wd, tvm::ffi::TensorView sd,
                 double eps, tvm::ffi::TensorView h, tvm::ffi::TensorView act, tvm::ffi::TensorView y) {
  TVM_FFI_ICHECK(wo.ndim() == 2) << "q4mlp_attn: the o_proj weight must be (H, A / 8)";
  int64_t rows = 0;
  const AttnParams a = CheckAttention("q4mlp_attn", q, k, v, cos, sin, heads, causal, scale, rope, wo.size(1) * 8, 1,
                                      res.dtype(), &rows);
  LaunchQ4Mlp(nullptr, res, wo, so, g, wgu, sgu, wd, sd, eps, h, act, y, nullptr, nullptr, &a);
}
// the launch attributes the kernel's launches take in this process with the variables as they are now (after one
// launch: for measurements)
std::string Q4MlpI8Launch() {
  if (!Q4MlpCooperative()) return ProgrammaticLaunch() ? "programmatic" : "plain";
  return ProgrammaticLaunch() && !both_refused.load() ? "cooperative, programmatic" : "cooperative";
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4mlp_i8, Q4MlpI8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4mlp_attn_i8, Q4MlpAttnI8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4mlp_i8_launch, Q4MlpI8Launch);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4mlp_i8_trace, Q4MlpI8Trace);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4mlp_i8_kernel, Q4MlpI8Kernel);
