// A feasibility prototype (benchmarks only, not served): the code predictor's whole frame at
// batch 1 as ONE persistent kernel, one CTA per SM, every CTA holding the residual stream in
// shared memory, grid barriers between the dependent stages, and each stage's weight slice
// copied into shared memory (cp.async) two stages ahead, so HBM streams while CTAs wait at
// barriers. Question it answers: what a dependent stage costs when its weights are already
// on chip (the served frame: ~28 launches a pass at ~4.6 us each, 1.9 ms a frame on the H200;
// the Triton persistent pass of 2026-11-30 spent ~5 us a stage on memory round trips).
//
// Stages of one pass (one token), per layer l (hidden 1024, 16 q / 8 kv heads of 128,
// intermediate 3072; FP8 e4m3 weights with a float scale per output row):
//   A  x += d (l > 0); RMSNorm; this CTA's rows of W_qkv              -> qkv      | barrier
//   B  head h = cta % 16: q/k RMSNorm, RoPE, attention over the pass's positions (the new k/v
//      written to the cache once per kv head); its rows of W_o[:, h] summed into o (atomics)
//                                                                     -> o        | barrier
//   C  x += o; RMSNorm; its columns of gate and up, silu(g) * u       -> act      | barrier
//   D  its rows of W_down                                             -> d        | barrier
// then (passes 1..15) H: x += d; final RMSNorm; its rows of the pass's head -> logits | barrier;
// every CTA runs the sampler itself (the same token on every CTA), and the next pass's input is the
// token's row of a folded table (small_to_mtp_projection applied to the codebook embedding
// ahead of time: a lookup, no stage). 16 passes: pass 0 the talker's hidden state, pass 1 the
// codebook-0 embedding, passes 1..15 each give one code (greedy or sampled).
// Barriers: 20 a pass (+1 with a head; none after pass 0's last stage): 334 a frame.
//
// Each stage's norm weights, row scales and RoPE row travel with its weights (issue_side).
// MODE 0: as above. 1: barriers only (no loads, no math). 2: no prefetch (a stage's own
// weights copied when it starts, waited for). 3: no barriers (the stages race: garbage
// results, their own time).

#include <cuda_fp8.h>
#include <cstdint>

namespace megaframe {

constexpr int H = 1024, NH = 16, NKV = 8, HD = 128, I = 3072, L = 5, V = 2048, G = 16;
constexpr int QKV = (NH + 2 * NKV) * HD;  // 4096
constexpr int THREADS = 256, WARPS = THREADS / 32;
constexpr int NBUF = 3;                  // weight buffers: stage s+2 loads while s runs
constexpr int SIDE = 2048;               // floats beside each buffer: the stage's norm
                                         // weights, row scales, RoPE row (issue_side)
constexpr int PASSES = G;                // 16 (pass 0: the talker's hidden state)
constexpr int STAGES = 20 + (PASSES - 1) * 21;

struct Params {
    const uint8_t* wqkv; const float* sqkv;   // [L, 4096, 1024], [L, 4096]
    const uint8_t* wo; const float* so;       // [L, 1024, 2048], [L, 1024]
    const uint8_t* wgu; const float* sgu;     // [L, 6144, 1024] gate rows then up rows
    const uint8_t* wd; const float* sd;       // [L, 1024, 3072], [L, 1024]
    const uint8_t* whead; const float* shead; // [15, 2048, 1024], [15, 2048]
    const float* in_norm; const float* post_norm;  // [L, 1024]
    const float* q_norm; const float* k_norm;      // [L, 128]
    const float* final_norm;                       // [1024]
    const float* tables;   // [14, 2048, 1024]: projected embeddings of codebooks 1..14
    const float* x_in;     // [2, 1024]: passes 0 and 1
    const float* rope_cos; const float* rope_sin;  // [16, 64]
    float* qkv; float* o; float* act; float* d;    // scratch (o zeroed before the launch)
    float* logits;         // [15, 2048]
    float* kcache; float* vcache;  // [L, 8, 16, 128]
    int* tokens;           // [15]
    unsigned* counter;     // zeroed before the launch: [1] (counting) or [ctas] (flags)
    int flag_barrier;      // 0: one counter (release add, acquire polls); 1: the same with
                           // full fences around it; 2: a word per CTA
    long long* stamps;     // null, or [2, STAGES, 3] clock64 of CTA 0 and the last CTA:
                           // stage start (weights ready), barrier arrival, barrier release
    int buf_bytes;         // one weight buffer's bytes (host: the largest stage slice)
    // sampling (ttsbuild.generation.sampling.sample; top_p 1): do_sample 0 = greedy
    int do_sample, top_k;
    float temperature;
    long long seed, counter_base;  // a pass's draw counter: counter_base + pass (frame * 16 + cb)
    float eps;
};

__host__ __device__ __forceinline__ int rows_begin(int n, int cta, int ctas) {
    return (int)(((long long)n * cta) / ctas);
}

// The output rows [r0, r1) a CTA computes in a stage of kind 0-4 (A qkv, B o, C gate/up
// columns, D down, H head): the weight copy, its side vectors and the stage all use these.
// B: head cta % NH's CTAs split W_o's rows among them (the first ctas % NH heads have one
// CTA more).
struct Rows { int r0, r1; };
__host__ __device__ __forceinline__ Rows stage_rows(int kind, int cta, int ctas) {
    if (kind == 1) {
        const int h = cta % NH, gi = cta / NH, m = ctas / NH + (h < ctas % NH ? 1 : 0);
        return {rows_begin(H, gi, m), rows_begin(H, gi + 1, m)};
    }
    const int n = kind == 0 ? QKV : kind == 2 ? I : kind == 3 ? H : V;
    return {rows_begin(n, cta, ctas), rows_begin(n, cta + 1, ctas)};
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// fenced: a full fence before the arrival and after the wait (cooperative groups' grid
// sync); without, the release add and acquire load alone order the CTA's writes (bar.sync
// before them: cumulativity), as CUTLASS's GenericBarrier does.
template <bool FENCED>
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (FENCED) __threadfence();
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counter) : "memory");
        unsigned v;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
            if (++spins > (1ll << 22)) __trap();  // a CTA never arrived (~seconds): fail, never hang
        } while (v < target);
        if (FENCED) __threadfence();
    }
    __syncthreads();
}

// The same barrier without an atomic: each CTA stores the barrier's number to its own word
// (release) and threads 0..ctas-1 of every CTA wait for one word each (acquire). No arrivals
// serialise on one address; the words of 132 CTAs lie in five 128-byte lines.
__device__ __forceinline__ void grid_barrier_flags(unsigned* flags, unsigned epoch, int ctas) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flags + blockIdx.x), "r"(epoch)
                     : "memory");
    }
    if ((int)threadIdx.x < ctas) {
        unsigned v;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n"
                         : "=r"(v) : "l"(flags + threadIdx.x) : "memory");
            if (++spins > (1ll << 22)) __trap();
        } while (v < epoch);
        __threadfence();
    }
    __syncthreads();
}

// stage index -> (pass, r): r 0..19 = layer r/4, kind r%4 (A, B, C, D); r 20 = head
__device__ __forceinline__ void stage_of(int sid, int& pass, int& r) {
    if (sid < 20) { pass = 0; r = sid; }
    else { pass = 1 + (sid - 20) / 21; r = (sid - 20) % 21; }
}

// Copy this CTA's weight slice of stage sid into buf (every thread issues its share).
__device__ __forceinline__ void copy_vec(float* dst, const float* src, int n) {  // n % 4 == 0
    for (int i = threadIdx.x; i < n / 4; i += THREADS) cp_async16(dst + 4 * i, src + 4 * i);
}
__device__ __forceinline__ void copy_rows(float* dst, const float* src, int n) {  // 4 B each
    for (int i = threadIdx.x; i < n; i += THREADS) cp_async4(dst + i, src + i);
}

// The small vectors a stage reads, copied beside its weights (side, SIDE floats):
//   A: input norm [0, 1024), qkv scales [1024, ...)      C: post norm, gate scales, up scales
//   B: q norm [0, 128), k norm [128, 256), cos [256, 320), sin [320, 384), o scales [384, ...)
//   D: down scales [0, ...)                              H: final norm, head scales
__device__ void issue_side(const Params& p, int pass, int r, float* side, int cta, int ctas) {
    const Rows w = stage_rows(r == 20 ? 4 : r % 4, cta, ctas);
    const int r0 = w.r0, r1 = w.r1;
    if (r == 20) {
        copy_vec(side, p.final_norm, H);
        copy_rows(side + H, p.shead + (size_t)(pass - 1) * V + r0, r1 - r0);
        return;
    }
    const int l = r / 4, kind = r % 4;
    if (kind == 0) {
        copy_vec(side, p.in_norm + l * H, H);
        copy_rows(side + H, p.sqkv + l * QKV + r0, r1 - r0);
    } else if (kind == 1) {
        copy_vec(side, p.q_norm + l * HD, HD);
        copy_vec(side + HD, p.k_norm + l * HD, HD);
        copy_vec(side + 2 * HD, p.rope_cos + pass * (HD / 2), HD / 2);
        copy_vec(side + 2 * HD + HD / 2, p.rope_sin + pass * (HD / 2), HD / 2);
        copy_rows(side + 3 * HD, p.so + l * H + r0, r1 - r0);
    } else if (kind == 2) {
        copy_vec(side, p.post_norm + l * H, H);
        copy_rows(side + H, p.sgu + (size_t)l * 2 * I + r0, r1 - r0);
        copy_rows(side + H + (r1 - r0), p.sgu + (size_t)l * 2 * I + I + r0, r1 - r0);
    } else {
        copy_rows(side, p.sd + l * H + r0, r1 - r0);
    }
}

__device__ void issue_stage(const Params& p, int sid, uint8_t* buf, int cta, int ctas) {
    if (sid >= STAGES) return;
    int pass, r;
    stage_of(sid, pass, r);
    const int tid = threadIdx.x;
    issue_side(p, pass, r, reinterpret_cast<float*>(buf + p.buf_bytes), cta, ctas);
    const Rows w = stage_rows(r == 20 ? 4 : r % 4, cta, ctas);
    const int r0 = w.r0, r1 = w.r1;
    if (r == 20) {  // head pass-1: rows of 1024
        const uint8_t* src = p.whead + ((size_t)(pass - 1) * V + r0) * H;
        int chunks = (r1 - r0) * H / 16;
        for (int i = tid; i < chunks; i += THREADS) cp_async16(buf + i * 16, src + i * 16);
        return;
    }
    const int l = r / 4, kind = r % 4;
    if (kind == 0) {
        const uint8_t* src = p.wqkv + ((size_t)l * QKV + r0) * H;
        int chunks = (r1 - r0) * H / 16;
        for (int i = tid; i < chunks; i += THREADS) cp_async16(buf + i * 16, src + i * 16);
    } else if (kind == 1) {  // W_o[r0:r1, h*128:(h+1)*128] of head h = cta % NH: 8 chunks a row
        const uint8_t* src = p.wo + ((size_t)l * H + r0) * (NH * HD) + (cta % NH) * HD;
        int chunks = (r1 - r0) * (HD / 16);
        for (int i = tid; i < chunks; i += THREADS) {
            int row = i / (HD / 16), c = i % (HD / 16);
            cp_async16(buf + i * 16, src + (size_t)row * (NH * HD) + c * 16);
        }
    } else if (kind == 2) {  // gate rows r0..r1, then up rows r0..r1
        int chunks = (r1 - r0) * H / 16;
        const uint8_t* g = p.wgu + ((size_t)l * 2 * I + r0) * H;
        const uint8_t* u = p.wgu + ((size_t)l * 2 * I + I + r0) * H;
        for (int i = tid; i < chunks; i += THREADS) {
            cp_async16(buf + i * 16, g + i * 16);
            cp_async16(buf + (size_t)chunks * 16 + i * 16, u + i * 16);
        }
    } else {
        const uint8_t* src = p.wd + ((size_t)l * H + r0) * I;
        int chunks = (r1 - r0) * I / 16;
        for (int i = tid; i < chunks; i += THREADS) cp_async16(buf + i * 16, src + i * 16);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// sum over the block of v (every thread gets it); red: WARPS floats of shared memory
__device__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < WARPS; ++i) t += red[i];
    return t;
}

// xn = x * rsqrt(mean(x^2) + eps) * w over H values
__device__ void rms_norm(const float* x, const float* w, float* xn, float eps, float* red) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += THREADS) ss += x[i] * x[i];
    float rstd = rsqrtf(block_sum(ss, red) / H + eps);
    for (int i = threadIdx.x; i < H; i += THREADS) xn[i] = x[i] * rstd * w[i];
    __syncthreads();
}

__device__ __forceinline__ float dot16(uint4 wq, const float* x) {
    const uint32_t u[4] = {wq.x, wq.y, wq.z, wq.w};
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        __nv_fp8x4_e4m3 q;
        q.__x = u[j];
        float4 f = static_cast<float4>(q);
        float4 a = *reinterpret_cast<const float4*>(x + 4 * j);
        s += f.x * a.x + f.y * a.y + f.z * a.z + f.w * a.w;
    }
    return s;
}

// rows x K weights in shared memory (row-major, FP8) times x (shared, K floats): a warp a
// row, the lanes along K; out(row, sum) called by lane 0
template <typename Out>
__device__ void gemv_smem(const uint8_t* w, int rows, int K, const float* x, Out out) {
    const int w_id = threadIdx.x / 32, lane = threadIdx.x % 32, chunks = K / 16;
    for (int r = w_id; r < rows; r += WARPS) {
        const uint8_t* wr = w + (size_t)r * K;
        float s = 0.f;
        for (int c = lane; c < chunks; c += 32)
            s += dot16(*reinterpret_cast<const uint4*>(wr + c * 16), x + c * 16);
        s = warp_sum(s);
        if (lane == 0) out(r, s);
    }
}

__device__ __forceinline__ uint32_t hash32(uint32_t x) {  // lowbias32, as sampling.hash32
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; return x ^ (x >> 16);
}

// sampling.uniform_noise's stream for (seed, counter), then its u for column i
__device__ __forceinline__ uint32_t noise_stream(long long seed, long long counter) {
    uint32_t key = hash32((uint32_t)(seed & 0xFFFFFFFFll)) ^
                   hash32((uint32_t)(((seed >> 32) ^ 0x68E31DA4ll) & 0xFFFFFFFFll));
    return hash32(key ^ hash32((uint32_t)((counter + 0x1B873593ll) & 0xFFFFFFFFll)));
}
__device__ __forceinline__ float gumbel(uint32_t stream, int i) {
    uint32_t bits = hash32(stream ^ hash32((uint32_t)i + 0x3C6EF372u));
    float u = fminf(((float)(bits >> 8) + 0.5f) * (1.0f / 16777216.0f), 1.0f - 5.9604645e-8f);
    return -logf(-logf(u));
}
// ascending uint32 key of a float's order
__device__ __forceinline__ uint32_t order_key(float f) {
    uint32_t b = __float_as_uint(f);
    return b ^ ((b & 0x80000000u) ? 0xFFFFFFFFu : 0x80000000u);
}

// (value, index) of the block's maximum, lowest index among ties; every thread gets it
__device__ void block_argmax(float& best, int& arg, float* red, int* ired) {
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oa = __shfl_xor_sync(0xffffffffu, arg, o);
        if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) { red[threadIdx.x / 32] = best; ired[threadIdx.x / 32] = arg; }
    __syncthreads();
    best = red[0]; arg = ired[0];
    for (int i = 1; i < WARPS; ++i)
        if (red[i] > best || (red[i] == best && ired[i] < arg)) { best = red[i]; arg = ired[i]; }
    __syncthreads();
}

__device__ int block_total(int n, int* ired) {  // sum of n over the block
    for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) ired[threadIdx.x / 32] = n;
    __syncthreads();
    int t = 0;
    for (int i = 0; i < WARPS; ++i) t += ired[i];
    __syncthreads();
    return t;
}

// The token of one pass from its logits (global, V): greedy, or Gumbel-max over
// logits / temperature kept by top-k (ties with the k-th kept). The winner over all tokens
// is the winner over the kept ones whenever it is kept (fewer than k tokens above it): the
// common case costs one count; otherwise the k-th largest is found bit by bit (32 counts).
__device__ int pick_token(const Params& p, const float* lg, long long counter, float* red,
                          int* ired) {
    constexpr int PER = V / THREADS;
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) v[j] = __ldcg(lg + threadIdx.x + j * THREADS);
    float best = -INFINITY;
    int arg = 0;
    if (!p.do_sample) {
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (v[j] > best) { best = v[j]; arg = threadIdx.x + j * THREADS; }
        block_argmax(best, arg, red, ired);
        return arg;
    }
    const uint32_t stream = noise_stream(p.seed, counter);
    float z[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        v[j] = v[j] / p.temperature;
        z[j] = v[j] + gumbel(stream, threadIdx.x + j * THREADS);
        if (z[j] > best) { best = z[j]; arg = threadIdx.x + j * THREADS; }
    }
    block_argmax(best, arg, red, ired);
    if (p.top_k <= 0 || p.top_k >= V) return arg;
    // the winner's scaled logit: from the thread that holds it
    __shared__ float s_w;
    if (arg % THREADS == (int)threadIdx.x) s_w = v[arg / THREADS];
    __syncthreads();
    const float sw = s_w;
    int mine = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) mine += v[j] > sw;
    const int above = block_total(mine, ired);
    if (above < p.top_k) return arg;
    uint32_t t = 0;  // the k-th largest's key: the largest t with count(key >= t) >= k
    for (int b = 31; b >= 0; --b) {
        uint32_t cand = t | (1u << b);
        int mine_b = 0;
#pragma unroll
        for (int j = 0; j < PER; ++j) mine_b += order_key(v[j]) >= cand;
        const int n = block_total(mine_b, ired);
        if (n >= p.top_k) t = cand;
    }
    best = -INFINITY; arg = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j)
        if (order_key(v[j]) >= t && z[j] > best) { best = z[j]; arg = threadIdx.x + j * THREADS; }
    block_argmax(best, arg, red, ired);
    return arg;
}

template <int MODE>
__global__ void __launch_bounds__(THREADS, 1) cp_megaframe_kernel(Params p) {
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t* wbuf = smem;                                             // NBUF x buf_bytes
    float* x = reinterpret_cast<float*>(smem + (size_t)NBUF * (p.buf_bytes + SIDE * 4));  // [H]
    float* xn = x + H;            // normed input / act [I]
    float* qv = xn + I;           // q [128]
    float* kv = qv + HD;          // k [128]
    float* vv = kv + HD;          // v [128]
    float* att = vv + HD;         // attention out [128]
    float* sc = att + HD;         // scores [16]
    float* red = sc + 16;         // [WARPS]
    int* tok_s = reinterpret_cast<int*>(red + 2 * WARPS);
    float* kbuf = reinterpret_cast<float*>(tok_s + 2 * WARPS);  // [16, 128]: a head's past k
    float* vbuf = kbuf + G * HD;                                 // [16, 128]: ...and v

    const int cta = blockIdx.x, ctas = gridDim.x, tid = threadIdx.x;
    unsigned barriers = 0;
    long long* st = p.stamps && tid == 0 && (cta == 0 || cta == ctas - 1)
                        ? p.stamps + (size_t)(cta == 0 ? 0 : 1) * STAGES * 3 : nullptr;
    int cur = 0;
    auto barrier = [&]() {
        ++barriers;
        __syncthreads();
        if (st) st[cur * 3 + 1] = clock64();
        if (MODE != 3) {
            if (p.flag_barrier == 2) grid_barrier_flags(p.counter, barriers, ctas);
            else if (p.flag_barrier == 1) grid_barrier<true>(p.counter, barriers * ctas);
            else grid_barrier<false>(p.counter, barriers * ctas);
        }
        if (st) st[cur * 3 + 2] = clock64();
    };
    const size_t slot_bytes = (size_t)p.buf_bytes + SIDE * sizeof(float);
    auto buf_of = [&](int sid) { return wbuf + (sid % NBUF) * slot_bytes; };

    if (MODE == 0 || MODE == 3) {  // prologue: stages 0 and 1 in flight
        issue_stage(p, 0, buf_of(0), cta, ctas); cp_commit();
        issue_stage(p, 1, buf_of(1), cta, ctas); cp_commit();
    }
    int tok = 0;
    for (int sid = 0; sid < STAGES; ++sid) {
        int pass, r;
        stage_of(sid, pass, r);
        if (MODE == 1) {
            if (!(pass == 0 && r == 19)) barrier();
            continue;
        }
        uint8_t* wb = buf_of(sid);
        __syncthreads();  // the buffer refilled next was the last stage's: all warps done
        if (MODE == 2) {
            issue_stage(p, sid, wb, cta, ctas); cp_commit(); cp_wait<0>();
        } else {
            issue_stage(p, sid + 2, buf_of(sid + 2), cta, ctas); cp_commit(); cp_wait<2>();
        }
        __syncthreads();
        cur = sid;
        if (st) st[sid * 3] = clock64();
        const int l = r / 4, kind = r == 20 ? 4 : r % 4;
        const float* side = reinterpret_cast<const float*>(wb + p.buf_bytes);
        if (kind == 0) {
            if (l == 0) {
                const float* src = pass < 2 ? p.x_in + pass * H
                                            : p.tables + ((size_t)(pass - 2) * V + tok) * H;
                for (int i = tid; i < H; i += THREADS) x[i] = __ldcg(src + i);
            } else {
                for (int i = tid; i < H; i += THREADS) x[i] += __ldcg(p.d + i);
            }
            __syncthreads();
            rms_norm(x, side, xn, p.eps, red);
            const auto [r0, r1] = stage_rows(0, cta, ctas);
            const float* s = side + H;
            float* y = p.qkv + r0;
            gemv_smem(wb, r1 - r0, H, xn, [&](int i, float v) { __stcg(y + i, v * s[i]); });
            barrier();
        } else if (kind == 1) {
            const int h = cta % NH, g = h / (NH / NKV), pos = pass;
            if (tid < HD) {
                qv[tid] = __ldcg(p.qkv + h * HD + tid);
                kv[tid] = __ldcg(p.qkv + NH * HD + g * HD + tid);
                vv[tid] = __ldcg(p.qkv + (NH + NKV) * HD + g * HD + tid);
            }
            __syncthreads();
            // q/k RMSNorm over the head (warps 0-3: q; 4-7: k), then RoPE (rotate-half)
            {
                float* t = tid < HD ? qv : kv;
                const int d0 = tid % HD;
                float v = t[d0] * t[d0];
                v = warp_sum(v);
                if (tid % 32 == 0) red[tid / 32] = v;
                __syncthreads();
                const int base = tid < HD ? 0 : 4;
                float ss = red[base] + red[base + 1] + red[base + 2] + red[base + 3];
                float rstd = rsqrtf(ss / HD + p.eps);
                const float* wn = side + (tid < HD ? 0 : HD);
                float nv = t[d0] * rstd * wn[d0];
                __syncthreads();
                t[d0] = nv;
                __syncthreads();
                const int f = d0 % (HD / 2);
                float c = side[2 * HD + f], sn = side[2 * HD + HD / 2 + f];
                float rot = d0 < HD / 2 ? -t[d0 + HD / 2] : t[d0 - HD / 2];
                float outv = t[d0] * c + rot * sn;
                __syncthreads();
                t[d0] = outv;
                __syncthreads();
            }
            float* kc = p.kcache + ((size_t)(l * NKV + g) * G) * HD;
            float* vc = p.vcache + ((size_t)(l * NKV + g) * G) * HD;
            if (cta < NH && h % (NH / NKV) == 0 && tid < HD) {  // one writer per kv head
                __stcg(kc + pos * HD + tid, kv[tid]);
                __stcg(vc + pos * HD + tid, vv[tid]);
            }
            for (int i = tid; i < pos * HD / 4; i += THREADS) {  // past rows, one batch of loads
                reinterpret_cast<float4*>(kbuf)[i] = __ldcg(reinterpret_cast<const float4*>(kc) + i);
                reinterpret_cast<float4*>(vbuf)[i] = __ldcg(reinterpret_cast<const float4*>(vc) + i);
            }
            __syncthreads();
            const int w_id = tid / 32, lane = tid % 32;
            for (int j = w_id; j <= pos; j += WARPS) {
                float s = 0.f;
                for (int d0 = lane; d0 < HD; d0 += 32)
                    s += qv[d0] * (j == pos ? kv[d0] : kbuf[j * HD + d0]);
                s = warp_sum(s);
                if (lane == 0) sc[j] = s * rsqrtf((float)HD);
            }
            __syncthreads();
            if (tid < HD) {
                float m = -INFINITY;
                for (int j = 0; j <= pos; ++j) m = fmaxf(m, sc[j]);
                float den = 0.f, acc = 0.f;
                for (int j = 0; j <= pos; ++j) {
                    float e = __expf(sc[j] - m);
                    den += e;
                    acc += e * (j == pos ? vv[tid] : vbuf[j * HD + tid]);
                }
                att[tid] = acc / den;
            }
            __syncthreads();
            const auto [o0, o1] = stage_rows(1, cta, ctas);
            const float* so = side + 3 * HD;
            // 8 lanes a row (8 chunks of 16), 4 rows a warp at a time
            const int sub = lane / 8, c = lane % 8;
            for (int base = w_id * 4; base < o1 - o0; base += WARPS * 4) {  // warp-uniform
                const int rr = base + sub;
                const bool row = rr < o1 - o0;
                float s = row ? dot16(*reinterpret_cast<const uint4*>(wb + rr * HD + c * 16),
                                      att + c * 16) : 0.f;
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                s += __shfl_xor_sync(0xffffffffu, s, 4);
                if (row && c == 0) atomicAdd(p.o + o0 + rr, s * so[rr]);
            }
            barrier();
        } else if (kind == 2) {
            for (int i = tid; i < H; i += THREADS) x[i] += __ldcg(p.o + i);
            __syncthreads();
            rms_norm(x, side, xn, p.eps, red);
            const auto [j0, j1] = stage_rows(2, cta, ctas);
            const int n = j1 - j0;
            const float* sg = side + H;
            const float* su = sg + n;
            // gate and up of column j in the same warp: rows j and n + j of the buffer
            const int w_id = tid / 32, lane = tid % 32, chunks = H / 16;
            for (int j = w_id; j < n; j += WARPS) {
                const uint8_t* wg = wb + (size_t)j * H;
                const uint8_t* wu = wb + (size_t)(n + j) * H;
                float a = 0.f, b = 0.f;
                for (int c = lane; c < chunks; c += 32) {
                    a += dot16(*reinterpret_cast<const uint4*>(wg + c * 16), xn + c * 16);
                    b += dot16(*reinterpret_cast<const uint4*>(wu + c * 16), xn + c * 16);
                }
                a = warp_sum(a) * sg[j];
                b = warp_sum(b) * su[j];
                if (lane == 0) __stcg(p.act + j0 + j, a / (1.f + __expf(-a)) * b);
            }
            barrier();
        } else if (kind == 3) {
            for (int i = tid; i < I; i += THREADS) xn[i] = __ldcg(p.act + i);
            __syncthreads();
            const auto [r0, r1] = stage_rows(3, cta, ctas);
            const float* s = side;
            float* y = p.d + r0;
            gemv_smem(wb, r1 - r0, I, xn, [&](int i, float v) { __stcg(y + i, v * s[i]); });
            if (cta == 0)  // every CTA read o in C (before the last barrier): zero it for B
                for (int i = tid; i < H; i += THREADS) __stcg(p.o + i, 0.f);
            if (!(pass == 0 && l == L - 1)) barrier();  // pass 0 has no head: nothing reads d
        } else {  // head of codebook `pass`, then every CTA's own argmax
            for (int i = tid; i < H; i += THREADS) x[i] += __ldcg(p.d + i);
            __syncthreads();
            rms_norm(x, side, xn, p.eps, red);
            const auto [r0, r1] = stage_rows(4, cta, ctas);
            const float* s = side + H;
            float* y = p.logits + (size_t)(pass - 1) * V + r0;
            gemv_smem(wb, r1 - r0, H, xn, [&](int i, float v) { __stcg(y + i, v * s[i]); });
            barrier();
            const float* lg = p.logits + (size_t)(pass - 1) * V;
            tok = MODE == 3 ? 0 : pick_token(p, lg, p.counter_base + pass, red, tok_s);
            if (cta == 0 && tid == 0) p.tokens[pass - 1] = tok;
        }
    }
    if (MODE == 0 || MODE == 3) cp_wait<0>();
}

// The largest stage slice of one CTA, in bytes.
inline int buf_bytes_for(int ctas) {
    constexpr int row_bytes[5] = {H, HD, 2 * H, I, H};  // A, B, C (gate and up), D, H
    int b = 0;
    for (int cta = 0; cta < ctas; ++cta)
        for (int kind = 0; kind < 5; ++kind) {
            const Rows w = stage_rows(kind, cta, ctas);
            b = (w.r1 - w.r0) * row_bytes[kind] > b ? (w.r1 - w.r0) * row_bytes[kind] : b;
        }
    return (b + 15) / 16 * 16;
}

inline size_t smem_bytes(int buf_bytes) {
    return (size_t)NBUF * (buf_bytes + SIDE * sizeof(float)) +
           sizeof(float) * (H + I + 4 * HD + 16 + 2 * 8 + 2 * 8 + 2 * G * HD) + 64;
}

}  // namespace megaframe

#ifdef MEGAFRAME_INSTANTIATE  // an offline compile check: nvcc -DMEGAFRAME_INSTANTIATE -c
template __global__ void megaframe::cp_megaframe_kernel<0>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<1>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<2>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<3>(megaframe::Params);
#endif

#ifdef TORCH_EXTENSION_NAME
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

namespace {

template <int MODE>
void launch_mode(const megaframe::Params& p, int ctas, size_t smem, cudaStream_t stream) {
    auto k = megaframe::cp_megaframe_kernel<MODE>;
    static size_t set = 0;  // once per size, outside any capture's first replay
    if (set != smem) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        set = smem;
    }
    k<<<ctas, megaframe::THREADS, smem, stream>>>(p);
}

// ws: the 28 tensors of Params in order (bench_megaframe.py); FP8 weights as uint8 views;
// stamps: int64 [2, STAGES, 3] or empty; sampling as ttsbuild.generation.sampling (top_p 1).
// Zeroes the barrier counter and o on the current stream, then launches (capturable).
void run(std::vector<torch::Tensor> ws, int64_t mode, int64_t ctas, torch::Tensor stamps,
         int64_t do_sample, int64_t top_k, double temperature, int64_t seed, int64_t frame,
         int64_t flag_barrier) {
    TORCH_CHECK(ws.size() == 28, "28 tensors expected, got ", ws.size());
    for (auto& t : ws) TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "CUDA contiguous tensors only");
    megaframe::Params p;
    int i = 0;
    auto u8 = [&]() { return ws[i++].data_ptr<uint8_t>(); };
    auto f = [&]() { return ws[i++].data_ptr<float>(); };
    p.wqkv = u8(); p.sqkv = f(); p.wo = u8(); p.so = f(); p.wgu = u8(); p.sgu = f();
    p.wd = u8(); p.sd = f(); p.whead = u8(); p.shead = f();
    p.in_norm = f(); p.post_norm = f(); p.q_norm = f(); p.k_norm = f(); p.final_norm = f();
    p.tables = f(); p.x_in = f(); p.rope_cos = f(); p.rope_sin = f();
    p.qkv = f(); p.o = f(); p.act = f(); p.d = f(); p.logits = f();
    p.kcache = f(); p.vcache = f();
    p.tokens = ws[i++].data_ptr<int>();
    p.counter = reinterpret_cast<unsigned*>(ws[i++].data_ptr<int>());
    p.stamps = stamps.numel() ? reinterpret_cast<long long*>(stamps.data_ptr<int64_t>()) : nullptr;
    TORCH_CHECK(!stamps.numel() || stamps.numel() == 2 * megaframe::STAGES * 3, "stamps: [2, STAGES, 3]");
    p.eps = 1e-6f;
    TORCH_CHECK(temperature > 0, "temperature must be > 0");
    p.do_sample = (int)do_sample; p.top_k = (int)top_k; p.temperature = (float)temperature;
    p.seed = seed; p.counter_base = frame * megaframe::G;
    int dev = ws[0].get_device(), sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    TORCH_CHECK(ctas >= 2 * megaframe::NH && ctas <= sms, "ctas must be in [32, SMs = ", sms, "]");
    p.buf_bytes = megaframe::buf_bytes_for((int)ctas);
    size_t smem = megaframe::smem_bytes(p.buf_bytes);
    TORCH_CHECK(smem <= 227 * 1024, "shared memory ", smem, " > 227 KiB: use more CTAs");
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    p.flag_barrier = (int)flag_barrier;
    TORCH_CHECK(ws[27].numel() >= ctas, "the barrier words: one per CTA");
    TORCH_CHECK(ctas <= megaframe::THREADS, "at most one CTA per thread of a CTA (flags)");
    cudaMemsetAsync(p.counter, 0, sizeof(int) * ctas, stream);
    cudaMemsetAsync(p.o, 0, sizeof(float) * megaframe::H, stream);
    switch (mode) {
        case 0: launch_mode<0>(p, (int)ctas, smem, stream); break;
        case 1: launch_mode<1>(p, (int)ctas, smem, stream); break;
        case 2: launch_mode<2>(p, (int)ctas, smem, stream); break;
        case 3: launch_mode<3>(p, (int)ctas, smem, stream); break;
        default: TORCH_CHECK(false, "mode 0-3");
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run, "the code predictor's frame, one kernel"); }
#endif
