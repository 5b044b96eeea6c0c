// The talker's decode step at batch 1 (one token, all 28 layers) as ONE persistent kernel:
// one CTA an SM, a grid barrier after each dependent stage, and each stage's FP8 weights
// brought into L2 by bulk prefetches issued `dist` stages ahead, so HBM streams the whole
// step's weights back to back while the CTAs compute and wait at barriers.
//
// Why: on the unfused kernels the step at batch 1 takes ~1.05-1.09 ms on an H200 against a
// 0.29-ms FP8 weight read (benchmarks/kernels/RESULTS.md), and removing 84 of its ~250
// launches changed nothing: each small GEMV (2-25 MB) streams at 1-2 TB/s because it is
// over within one or two DRAM latencies. Here no stage starts its weights cold.
//
// Stages of layer l (hidden 2048, 16 q / 8 kv heads of 128, intermediate 6144; FP8 e4m3
// weights with a float scale per output row; every CTA holds the fp32 residual stream in
// shared memory and updates it identically):
//   A  x += d (l > 0); RMSNorm; this CTA's rows of W_qkv                     -> qkv  | barrier
//   B  per (kv head, chunk of 32 positions), a warp: q/k RMSNorm + RoPE of the
//      group's two q heads (and of the new k, in the chunk holding the position, which also
//      writes k and v to the cache), scores, softmax partials; the last chunk of a kv head
//      to finish combines its heads                                            -> attn | barrier
//   C0 this CTA's rows of W_o                                                  -> o    | barrier
//   C  x += o; RMSNorm; its rows of gate and up, silu(g) * u                   -> act  | barrier
//   D  its rows of W_down                                                      -> d    | barrier
// then CTA 0: x += d, final RMSNorm, the output row (bf16).
// The math is the float32 reference's (runtime/talker_megastep.py `reference`): fp32
// activations, weights as fp8 * row scale, the new k and v rounded to the cache's bf16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace {

constexpr int H = 2048, NH = 16, NKV = 8, HD = 128, I = 6144;
constexpr int QKV = (NH + 2 * NKV) * HD;  // 4096
constexpr int THREADS = 256, WARPS = THREADS / 32;
constexpr int CH = 32;                    // positions of an attention item (a lane each)
constexpr int PART = 4 + 2 * HD;          // a partial: m0, m1, l0, l1, acc0[128], acc1[128]
constexpr int STAGES_PER_LAYER = 5;       // A, B, C0, C, D

struct Params {
    const __nv_bfloat16* x_in;  // [H]
    __nv_bfloat16* out;         // [H]
    const int64_t* wptr;      // [L, 4]: qkv, o, gate_up, down (FP8 [N, K] row-major)
    const int64_t* sptr;      // [L, 4]: their row scales (float [N])
    const float* norms;         // [L, 2 H + 2 HD]: input norm, post norm, q norm, k norm
    const float* final_norm;    // [H]
    const float* inv_freq;      // [HD / 2]
    __nv_bfloat16* kc;          // [L, slots, NKV, S, HD]
    __nv_bfloat16* vc;
    const int64_t* slot;      // [1]
    const int64_t* pos;       // [1]
    float* qkv;                 // [QKV]
    float* attn;                // [H]
    float* o;                   // [H]
    float* act;                 // [I]
    float* d;                   // [H]
    float* part;                // [NKV, max_chunks, PART]
    unsigned* counter;          // the grid barrier's count, [0]; exits [32]; chunk counts [64 + 32 g]
    int layers, slots, S, max_chunks, dist;
    float eps;
};

__device__ __forceinline__ void csync() { __syncthreads(); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Reads of what other CTAs wrote in this launch: through L2 only (no stale L1 line).
__device__ __forceinline__ float ldcg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float4 ldcg4(const float* p) {
    return __ldcg(reinterpret_cast<const float4*>(p));
}
// Weights: read once a step, streamed from L2 (prefetched), not kept in L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
    if (bytes) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes)
                            : "memory");
}

// sum over 16 FP8 weights (one 16-byte word) times 16 activations
__device__ __forceinline__ float dot16(uint4 w, const float* x) {
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(words[i] & 0xffffu), __NV_E4M3);
        const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(words[i] >> 16), __NV_E4M3);
        const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
        acc = fmaf(a.x, x[4 * i], acc);
        acc = fmaf(a.y, x[4 * i + 1], acc);
        acc = fmaf(b.x, x[4 * i + 2], acc);
        acc = fmaf(b.y, x[4 * i + 3], acc);
    }
    return acc;
}

// The grid barrier: a release add, thread 0 polls with acquire loads (bar.sync before and
// after: the CTA's writes before it are ordered, and its reads after it see the others').
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
    csync();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counter) : "memory");
        unsigned v;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
            if (++spins > (1ll << 24)) __trap();  // a CTA never arrived: fail, never hang
        } while (v < target);
    }
    csync();
}

// Rows of an N-row stage a warp (the grid's warps in order, a CTA's rows contiguous).
struct Rows { int r0, r1; };
__device__ __forceinline__ Rows warp_rows(int n, int gw, int gws) {
    const int per = (n + gws - 1) / gws;
    const int r0 = min(n, gw * per);
    return {r0, min(n, r0 + per)};
}
__device__ __forceinline__ Rows cta_rows(int n, int cta, int ctas) {
    const int per = (n + ctas * WARPS - 1) / (ctas * WARPS) * WARPS;
    const int r0 = min(n, cta * per);
    return {r0, min(n, r0 + per)};
}

// A block's RMSNorm of x [n] (shared) times w into y (shared): y = x * rsqrt(mean x^2 + eps) * w
__device__ void block_norm(const float* x, const float* w, float* y, int n, float eps, float* red) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += THREADS) ss += x[i] * x[i];
    ss = warp_sum(ss);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) red[warp] = ss;
    csync();
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) tot += red[i];
    const float r = rsqrtf(tot / n + eps);
    for (int i = threadIdx.x; i < n; i += THREADS) y[i] = x[i] * r * w[i];
    csync();  // red is reused; y is read by every warp
}

// A lane's activations for the 16-byte words lane, lane + 32, ... of a row of K: in registers
// where K <= 2048 (read once a stage, used for every row), else read from shared memory.
template <int KW>
struct XLane {
    static constexpr bool REG = KW <= 4;
    float r[REG ? KW * 16 : 1];
    const float* x;
    __device__ __forceinline__ XLane(const float* xs) : x(xs) {
        if constexpr (REG) {
            const int lane = threadIdx.x % 32;
#pragma unroll
            for (int j = 0; j < KW; ++j)
#pragma unroll
                for (int e = 0; e < 16; ++e) r[16 * j + e] = xs[16 * (lane + 32 * j) + e];
        }
    }
    __device__ __forceinline__ float dot(int j, uint4 w) const {
        if constexpr (REG) return dot16(w, r + 16 * j);
        else return dot16(w, x + 16 * (threadIdx.x % 32 + 32 * j));
    }
};

// A warp's GEMV rows [r0, r1) of an FP8 [N, K] weight against x (shared, K floats). K a
// multiple of 512: each lane takes the 16-byte words lane, lane + 32, ... of a row. RB rows
// at a time, their words all loaded before any is used. epi(row, sum) stores the output.
template <int K, int RB, typename Epi>
__device__ __forceinline__ void gemv_rows(const uint8_t* w, const float* x, int r0, int r1,
                                          Epi epi) {
    constexpr int KW = K / 512;  // words a lane a row
    const int lane = threadIdx.x % 32;
    if (r0 >= r1) return;
    const XLane<KW> xl(x);
    for (int r = r0; r < r1; r += RB) {
        uint4 wv[RB][KW];
#pragma unroll
        for (int i = 0; i < RB; ++i)
#pragma unroll
            for (int j = 0; j < KW; ++j)
                if (r + i < r1) wv[i][j] = ld_stream(w + (size_t)(r + i) * K + 16 * (lane + 32 * j));
#pragma unroll
        for (int i = 0; i < RB; ++i) {
            if (r + i >= r1) break;
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < KW; ++j) acc += xl.dot(j, wv[i][j]);
            acc = warp_sum(acc);
            if (lane == 0) epi(r + i, acc);
        }
    }
}

// The gate/up pairs: rows [r0, r1) of gate (rows 0..I-1) and of up (rows I..2I-1) together.
template <int RB>
__device__ __forceinline__ void gemv_gate_up(const uint8_t* w, const float* s, const float* x,
                                             int r0, int r1, float* act) {
    constexpr int K = H, KW = K / 512;
    const int lane = threadIdx.x % 32;
    if (r0 >= r1) return;
    const XLane<KW> xl(x);
    for (int r = r0; r < r1; r += RB) {
        uint4 g[RB][KW], u[RB][KW];
#pragma unroll
        for (int i = 0; i < RB; ++i)
#pragma unroll
            for (int j = 0; j < KW; ++j)
                if (r + i < r1) {
                    g[i][j] = ld_stream(w + (size_t)(r + i) * K + 16 * (lane + 32 * j));
                    u[i][j] = ld_stream(w + (size_t)(I + r + i) * K + 16 * (lane + 32 * j));
                }
#pragma unroll
        for (int i = 0; i < RB; ++i) {
            if (r + i >= r1) break;
            float ag = 0.f, au = 0.f;
#pragma unroll
            for (int j = 0; j < KW; ++j) {
                ag += xl.dot(j, g[i][j]);
                au += xl.dot(j, u[i][j]);
            }
            ag = warp_sum(ag) * s[r + i];
            au = warp_sum(au) * s[I + r + i];
            if (lane == 0) act[r + i] = ag / (1.f + expf(-ag)) * au;
        }
    }
}

// This CTA's part of stage `st`'s reads into L2 (thread 0; nothing waits for it).
__device__ void prefetch_stage(const Params& p, int st, int P, int cta, int ctas) {
    const int l = st / STAGES_PER_LAYER, kind = st % STAGES_PER_LAYER;
    if (l >= p.layers) return;
    const int64_t* wl = p.wptr + 4 * l;
    if (kind == 1) {  // B: the slot's cached k and v of this layer, one range per CTA < 16
        if (cta >= 2 * NKV) return;
        const int g = cta % NKV;
        const __nv_bfloat16* base = (cta < NKV ? p.kc : p.vc) +
            ((((size_t)l * p.slots + p.slot[0]) * NKV + g) * p.S) * HD;
        prefetch_l2(base, (unsigned)P * HD * 2);
        return;
    }
    const int which = kind == 0 ? 0 : kind - 1;  // qkv, o, gate_up, down
    const int n = which == 0 ? QKV : which == 2 ? I : H;
    const int k = which == 3 ? I : H;
    const Rows rows = cta_rows(n, cta, ctas);
    const uint8_t* w = reinterpret_cast<const uint8_t*>(wl[which]);
    prefetch_l2(w + (size_t)rows.r0 * k, (unsigned)(rows.r1 - rows.r0) * k);
    if (which == 2) prefetch_l2(w + (size_t)(I + rows.r0) * k, (unsigned)(rows.r1 - rows.r0) * k);
}

// q/k RMSNorm + RoPE of one head vector (a lane holds dims lane + 32 m, m < 4).
__device__ __forceinline__ void norm_rope(float v[4], const float* nw, const float* inv_freq,
                                          float position, float eps) {
    const int lane = threadIdx.x % 32;
    float ss = 0.f;
#pragma unroll
    for (int m = 0; m < 4; ++m) ss += v[m] * v[m];
    const float r = rsqrtf(warp_sum(ss) / HD + eps);
#pragma unroll
    for (int m = 0; m < 4; ++m) v[m] = v[m] * r * nw[lane + 32 * m];
#pragma unroll
    for (int m = 0; m < 2; ++m) {  // dim d < 64 and its partner d + 64 (rotate-half RoPE)
        float sn, cs;
        sincosf(position * inv_freq[lane + 32 * m], &sn, &cs);
        const float a = v[m], b = v[m + 2];
        v[m] = a * cs - b * sn;
        v[m + 2] = b * cs + a * sn;
    }
}

// Stage B's item (kv head g, chunk c) by one warp; qs: the warp's 2 x HD floats, kvn: 2 x HD.
__device__ void attention_item(const Params& p, int l, int g, int c, int nchunks, int P, int pos,
                               float* qs, float* kvn) {
    const int lane = threadIdx.x % 32;
    __syncwarp();  // the warp's last item has done with qs and kvn
    const float* nq = p.norms + (size_t)l * (2 * H + 2 * HD) + 2 * H;
    const float* nk = nq + HD;
    const float scale = rsqrtf((float)HD);
    const float fpos = (float)pos;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float v[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) v[m] = ldcg(p.qkv + (2 * g + hh) * HD + lane + 32 * m);
        norm_rope(v, nq, p.inv_freq, fpos, p.eps);
#pragma unroll
        for (int m = 0; m < 4; ++m) qs[hh * HD + lane + 32 * m] = v[m] * scale;
    }
    const size_t head = (((size_t)l * p.slots + p.slot[0]) * NKV + g) * p.S;
    __nv_bfloat16* kc = p.kc + head * HD;
    __nv_bfloat16* vc = p.vc + head * HD;
    const bool mine = c == nchunks - 1;  // this chunk holds the new position
    if (mine) {
        float k[4], v[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            k[m] = ldcg(p.qkv + (NH + g) * HD + lane + 32 * m);
            v[m] = ldcg(p.qkv + (NH + NKV + g) * HD + lane + 32 * m);
        }
        norm_rope(k, nk, p.inv_freq, fpos, p.eps);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const __nv_bfloat16 kb = __float2bfloat16(k[m]), vb = __float2bfloat16(v[m]);
            kc[(size_t)pos * HD + lane + 32 * m] = kb;
            vc[(size_t)pos * HD + lane + 32 * m] = vb;
            kvn[lane + 32 * m] = __bfloat162float(kb);
            kvn[HD + lane + 32 * m] = __bfloat162float(vb);
        }
    }
    __syncwarp();
    // scores: lane j -> position c * CH + j
    const int t = c * CH + lane;
    float s0 = -INFINITY, s1 = -INFINITY;
    if (t < P) {
        s0 = s1 = 0.f;
        if (t == pos) {
            for (int dd = 0; dd < HD; ++dd) {
                s0 = fmaf(qs[dd], kvn[dd], s0);
                s1 = fmaf(qs[HD + dd], kvn[dd], s1);
            }
        } else {
            const uint4* row = reinterpret_cast<const uint4*>(kc + (size_t)t * HD);
#pragma unroll 4
            for (int q = 0; q < HD / 8; ++q) {
                const uint4 w = row[q];
                const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = __bfloat1622float2(
                        *reinterpret_cast<const __nv_bfloat162*>(&words[i]));
                    const int dd = 8 * q + 2 * i;
                    s0 = fmaf(qs[dd], f.x, fmaf(qs[dd + 1], f.y, s0));
                    s1 = fmaf(qs[HD + dd], f.x, fmaf(qs[HD + dd + 1], f.y, s1));
                }
            }
        }
    }
    const float m0 = warp_max(s0), m1 = warp_max(s1);
    const float p0 = t < P ? expf(s0 - m0) : 0.f, p1 = t < P ? expf(s1 - m1) : 0.f;
    const float l0 = warp_sum(p0), l1 = warp_sum(p1);
    float a0[4] = {0.f, 0.f, 0.f, 0.f}, a1[4] = {0.f, 0.f, 0.f, 0.f};
    const int n = min(CH, P - c * CH);
#pragma unroll 8
    for (int j = 0; j < n; ++j) {
        const float q0 = __shfl_sync(0xffffffffu, p0, j), q1 = __shfl_sync(0xffffffffu, p1, j);
        const int tj = c * CH + j;
        float vv[4];
        if (tj == pos) {
#pragma unroll
            for (int i = 0; i < 4; ++i) vv[i] = kvn[HD + 4 * lane + i];
        } else {
            const uint2 w = *reinterpret_cast<const uint2*>(vc + (size_t)tj * HD + 4 * lane);
            const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
            const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
            vv[0] = x.x; vv[1] = x.y; vv[2] = y.x; vv[3] = y.y;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            a0[i] = fmaf(q0, vv[i], a0[i]);
            a1[i] = fmaf(q1, vv[i], a1[i]);
        }
    }
    float* out = p.part + ((size_t)g * p.max_chunks + c) * PART;
    if (lane == 0) {
        out[0] = m0; out[1] = m1; out[2] = l0; out[3] = l1;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[4 + 4 * lane + i] = a0[i];
        out[4 + HD + 4 * lane + i] = a1[i];
    }
    __threadfence();
    __syncwarp();
    unsigned* cnt = p.counter + 64 + 32 * g;
    unsigned last = 0;
    if (lane == 0) last = atomicAdd(cnt, 1u) == (unsigned)(nchunks - 1);
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) return;
    __threadfence();
    // the last chunk of kv head g combines its two q heads' partials (in chunk order): lane j
    // reads chunk j's maxima and sums (32 at a time), then the accumulators 8 chunks a batch
    // (16 loads in flight)
    const float* base = p.part + (size_t)g * p.max_chunks * PART;
    float mx0 = -INFINITY, mx1 = -INFINITY;
    for (int c0 = lane; c0 < nchunks; c0 += 32) {
        mx0 = fmaxf(mx0, ldcg(base + (size_t)c0 * PART));
        mx1 = fmaxf(mx1, ldcg(base + (size_t)c0 * PART + 1));
    }
    mx0 = warp_max(mx0);
    mx1 = warp_max(mx1);
    float den0 = 0.f, den1 = 0.f;
    float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c0 = 0; c0 < nchunks; c0 += 32) {
        const int c = c0 + lane;
        float e0 = 0.f, e1 = 0.f;
        if (c < nchunks) {
            const float* pc = base + (size_t)c * PART;
            e0 = expf(ldcg(pc) - mx0);
            e1 = expf(ldcg(pc + 1) - mx1);
            den0 = fmaf(e0, ldcg(pc + 2), den0);
            den1 = fmaf(e1, ldcg(pc + 3), den1);
        }
        const int cnt = min(32, nchunks - c0);
#pragma unroll 8
        for (int jj = 0; jj < cnt; ++jj) {
            const float f0 = __shfl_sync(0xffffffffu, e0, jj);
            const float f1 = __shfl_sync(0xffffffffu, e1, jj);
            const float* pc = base + (size_t)(c0 + jj) * PART;
            const float4 a = ldcg4(pc + 4 + 4 * lane), b = ldcg4(pc + 4 + HD + 4 * lane);
            acc0[0] = fmaf(f0, a.x, acc0[0]); acc0[1] = fmaf(f0, a.y, acc0[1]);
            acc0[2] = fmaf(f0, a.z, acc0[2]); acc0[3] = fmaf(f0, a.w, acc0[3]);
            acc1[0] = fmaf(f1, b.x, acc1[0]); acc1[1] = fmaf(f1, b.y, acc1[1]);
            acc1[2] = fmaf(f1, b.z, acc1[2]); acc1[3] = fmaf(f1, b.w, acc1[3]);
        }
    }
    den0 = warp_sum(den0);
    den1 = warp_sum(den1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        p.attn[(2 * g) * HD + 4 * lane + i] = acc0[i] / den0;
        p.attn[(2 * g + 1) * HD + 4 * lane + i] = acc1[i] / den1;
    }
    if (lane == 0) *cnt = 0;  // for the next layer (ordered by the barrier after this stage)
}

__global__ void __launch_bounds__(THREADS, 1) talker_step_kernel(Params p) {
    extern __shared__ float smem[];
    float* xres = smem;                 // [H] the residual stream
    float* h = xres + H;                // [I] the normed input of a stage (or act for D)
    float* red = h + I;                 // [32]
    float* qs = red + 32;               // [WARPS, 2 HD]
    float* kvn = qs + WARPS * 2 * HD;   // [WARPS, 2 HD]
    const int cta = blockIdx.x, ctas = gridDim.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gw = cta * WARPS + warp, gws = ctas * WARPS;
    // (the engine clamps the position to the cache; clamped here too: never out of bounds)
    const int pos = (int)max((int64_t)0, min(p.pos[0], (int64_t)p.S - 1)), P = pos + 1;
    const int nchunks = (P + CH - 1) / CH;
    const int stages = p.layers * STAGES_PER_LAYER;

    if (threadIdx.x == 0)
        for (int s = 0; s < p.dist && s < stages; ++s) prefetch_stage(p, s, P, cta, ctas);
    for (int i = threadIdx.x; i < H; i += THREADS) xres[i] = __bfloat162float(p.x_in[i]);
    csync();
    unsigned epoch = 0;
    for (int st = 0; st < stages; ++st) {
        const int l = st / STAGES_PER_LAYER, kind = st % STAGES_PER_LAYER;
        if (threadIdx.x == 0 && p.dist > 0) prefetch_stage(p, st + p.dist, P, cta, ctas);
        const float* nw = p.norms + (size_t)l * (2 * H + 2 * HD);
        const uint8_t* w = reinterpret_cast<const uint8_t*>(p.wptr[4 * l + (kind == 0 ? 0 : kind - 1)]);
        const float* s = reinterpret_cast<const float*>(p.sptr[4 * l + (kind == 0 ? 0 : kind - 1)]);
        if (kind == 0) {  // A
            if (l > 0) {
                for (int i = threadIdx.x; i < H; i += THREADS) xres[i] += ldcg(p.d + i);
                csync();
            }
            block_norm(xres, nw, h, H, p.eps, red);
            const Rows r = warp_rows(QKV, gw, gws);
            gemv_rows<H, 4>(w, h, r.r0, r.r1, [&](int row, float v) { p.qkv[row] = v * s[row]; });
        } else if (kind == 1) {  // B
            const int items = NKV * nchunks;
            for (int it = warp * ctas + cta; it < items; it += gws)
                attention_item(p, l, it % NKV, it / NKV, nchunks, P, pos, qs + warp * 2 * HD,
                               kvn + warp * 2 * HD);
        } else if (kind == 2) {  // C0
            for (int i = threadIdx.x; i < H; i += THREADS) h[i] = ldcg(p.attn + i);
            csync();
            const Rows r = warp_rows(H, gw, gws);
            gemv_rows<H, 4>(w, h, r.r0, r.r1, [&](int row, float v) { p.o[row] = v * s[row]; });
        } else if (kind == 3) {  // C
            for (int i = threadIdx.x; i < H; i += THREADS) xres[i] += ldcg(p.o + i);
            csync();
            block_norm(xres, nw + H, h, H, p.eps, red);
            const Rows r = warp_rows(I, gw, gws);
            gemv_gate_up<2>(w, s, h, r.r0, r.r1, p.act);
        } else {  // D
            for (int i = threadIdx.x; i < I; i += THREADS) h[i] = ldcg(p.act + i);
            csync();
            const Rows r = warp_rows(H, gw, gws);
            gemv_rows<I, 1>(w, h, r.r0, r.r1, [&](int row, float v) { p.d[row] = v * s[row]; });
        }
        grid_barrier(p.counter, ++epoch * (unsigned)ctas);
    }
    if (cta == 0) {
        for (int i = threadIdx.x; i < H; i += THREADS) xres[i] += ldcg(p.d + i);
        csync();
        block_norm(xres, p.final_norm, h, H, p.eps, red);
        for (int i = threadIdx.x; i < H; i += THREADS) p.out[i] = __float2bfloat16(h[i]);
    }
    // the last CTA out zeroes the barrier's count for the next launch (every CTA has passed
    // every barrier by then: nobody polls it any more)
    if (threadIdx.x == 0) {
        const unsigned out = atomicAdd(p.counter + 32, 1u);
        if (out == (unsigned)ctas - 1) {
            p.counter[0] = 0;
            p.counter[32] = 0;
        }
    }
    (void)lane;
}

int smem_bytes() { return (H + I + 32 + 2 * WARPS * 2 * HD) * (int)sizeof(float); }

}  // namespace

#ifdef TORCH_EXTENSION_NAME  // an offline compile check: nvcc -c without it (no torch headers)
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>


// One step. x_in, out: bf16 [H]; wptr, sptr: int64 [L, 4] device addresses; norms: f32
// [L, 2H + 2HD]; caches bf16 [L, slots, NKV, S, HD]; slot, pos: int64 [1]; scratch: f32
// (scratch_floats(S)); counter: int32 [64 + 32 NKV], zero before the first launch.
void talker_step(torch::Tensor x_in, torch::Tensor out, torch::Tensor wptr, torch::Tensor sptr,
                 torch::Tensor norms, torch::Tensor final_norm, torch::Tensor inv_freq,
                 torch::Tensor kc, torch::Tensor vc, torch::Tensor slot, torch::Tensor pos,
                 torch::Tensor scratch, torch::Tensor counter, int64_t ctas, int64_t dist,
                 double eps) {
    TORCH_CHECK(x_in.is_cuda() && x_in.scalar_type() == at::kBFloat16 && x_in.numel() == H,
                "x_in: bf16 [2048] on the GPU");
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.numel() == H, "out: bf16 [2048]");
    TORCH_CHECK(kc.dim() == 5 && kc.size(2) == NKV && kc.size(4) == HD &&
                kc.scalar_type() == at::kBFloat16 && kc.is_contiguous() &&
                vc.sizes() == kc.sizes() && vc.is_contiguous() &&
                vc.scalar_type() == at::kBFloat16, "caches: bf16 [L, slots, 8, S, 128]");
    TORCH_CHECK(slot.scalar_type() == at::kLong && pos.scalar_type() == at::kLong,
                "slot, pos: int64");
    const int layers = (int)kc.size(0), S = (int)kc.size(3);
    TORCH_CHECK(wptr.numel() == 4 * layers && sptr.numel() == 4 * layers, "wptr, sptr: [L, 4]");
    TORCH_CHECK(norms.numel() == (int64_t)layers * (2 * H + 2 * HD), "norms: [L, 2H + 2HD]");
    const int max_chunks = (S + CH - 1) / CH;
    TORCH_CHECK(scratch.scalar_type() == at::kFloat &&
                scratch.numel() >= (int64_t)QKV + 3 * H + I + (int64_t)NKV * max_chunks * PART,
                "scratch too small");
    TORCH_CHECK(counter.scalar_type() == at::kInt && counter.numel() >= 64 + 32 * NKV,
                "counter: int32 [64 + 32 * 8]");
    Params p;
    p.x_in = reinterpret_cast<const __nv_bfloat16*>(x_in.data_ptr());
    p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    p.wptr = wptr.data_ptr<int64_t>();
    p.sptr = sptr.data_ptr<int64_t>();
    p.norms = norms.data_ptr<float>();
    p.final_norm = final_norm.data_ptr<float>();
    p.inv_freq = inv_freq.data_ptr<float>();
    p.kc = reinterpret_cast<__nv_bfloat16*>(kc.data_ptr());
    p.vc = reinterpret_cast<__nv_bfloat16*>(vc.data_ptr());
    p.slot = slot.data_ptr<int64_t>();
    p.pos = pos.data_ptr<int64_t>();
    float* f = scratch.data_ptr<float>();
    p.qkv = f; f += QKV;
    p.attn = f; f += H;
    p.o = f; f += H;
    p.act = f; f += I;
    p.d = f; f += H;
    p.part = f;
    p.counter = reinterpret_cast<unsigned*>(counter.data_ptr<int>());
    p.layers = layers;
    p.slots = (int)kc.size(1);
    p.S = S;
    p.max_chunks = max_chunks;
    p.dist = (int)dist;
    p.eps = (float)eps;
    const int bytes = smem_bytes();
    static bool configured = false;
    if (!configured) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(talker_step_kernel,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        configured = true;
    }
    void* args[] = {&p};
    C10_CUDA_CHECK(cudaLaunchCooperativeKernel((void*)talker_step_kernel, dim3((unsigned)ctas),
                                               dim3(THREADS), args, (size_t)bytes,
                                               at::cuda::getCurrentCUDAStream()));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("talker_step", &talker_step, "the talker's decode step at batch 1, one kernel");
}
#endif
