// The code predictor's whole frame at batch 1 (the engine's plan.megaframe_code_predictor, off
// by default; benchmarks/kernels/megapass) as ONE persistent kernel, one CTA per SM, every CTA
// holding the residual stream in shared memory, grid barriers between the dependent stages,
// and each stage's weight slice copied into shared memory two stages ahead, so HBM streams
// while CTAs wait at barriers. It began as a question: what a dependent stage costs when its
// weights are already on chip (the fused frame: ~28 launches a pass at ~4.6 us each, 1.9 ms a
// frame on the H200; the Triton persistent pass of 2026-11-30 spent ~5 us a stage on memory
// round trips).
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
// The stages' threads (consumers): 256 (8 warps), or 512 (16 warps) where the extension is built
// with -DMEGAFRAME_THREADS=512 (cp_megaframe.extension(threads=512)): twice the warps to hide
// a stage's latencies (the 2026-12-05 profile: issued IPC 0.88 of 4, ~10 cycles a warp between
// issues); then the GEMVs take fewer rows a warp (A 2, H 1) and D splits K over two warps.
// Measured (H100 run 13): no faster (1.311 against 1.302 ms a frame): B's and C's linears
// shrink, the norms' block reductions grow, A's and D's linears stay. 256 is the build.
#ifndef MEGAFRAME_THREADS
#define MEGAFRAME_THREADS 256
#endif
constexpr int THREADS = MEGAFRAME_THREADS, WARPS = THREADS / 32;
static_assert(THREADS == 256 || THREADS == 512, "MEGAFRAME_THREADS: 256 or 512");
constexpr int RA = WARPS >= 16 ? 2 : 4;   // stage A's rows a warp (W_qkv: ~31 rows a CTA)
constexpr int RH = WARPS >= 16 ? 1 : 2;   // the head's (~16 rows a CTA)
constexpr int KSD = WARPS >= 16 ? 2 : 1;  // stage D's warps a row (W_down: ~8 rows, K 3072)
constexpr int BLOCK = THREADS + 32;  // + a producer warp (OPT_PRODUCER; else it exits at once)
constexpr int NBUF = 3;                  // weight buffers: stage s+2 loads while s runs
constexpr int SIDE = 2048;               // floats beside each buffer: the stage's norm
                                         // weights, row scales, RoPE row (issue_side)
constexpr int PASSES = G;                // 16 (pass 0: the talker's hidden state)
constexpr int STAGES = 20 + (PASSES - 1) * 21;
constexpr int NSTAMP = 7;
// OPT_READ_FIRST: a stage reads its activations before it issues the weight copy of the stage
//   ahead (else after: the read waits behind that copy's requests in the SM's load pipeline).
// OPT_TMA: weights copied by the TMA unit (cp.async.bulk, one request a contiguous slice,
//   completion on an mbarrier), not as 16-byte cp.async by every thread.
// OPT_DIST1: the weight copy one stage ahead (else two).
// OPT_PRODUCER (with OPT_TMA): a warp of its own issues every copy (weights and side vectors)
//   as soon as a buffer is free (NBUF stages ahead), so no stage's threads stall on an issue.
// OPT_COOPERATIVE (host): a cooperative launch, so the CUDA runtime starts the grid only when
//   every CTA can be resident at once (a grid barrier never waits on a CTA that cannot start:
//   beside another stream's persistent kernel, or inside a green context of fewer SMs, a
//   plain launch could wait for ever).
// OPT_TWO_TOKEN: passes 0 and 1 (the talker's hidden state at position 0, codebook 0's
//   embedding at position 1) as one pass of two tokens, as the model's own prefill runs them:
//   pass 0's 20 stages (19 grid barriers) are skipped, and pass 1's stages take two rows, the
//   weights in shared memory read once for both. Each row's sums run in the same order as in
//   a pass of its own. Activation buffers of two rows (TT below).
// OPT_XREDUCE: a GEMV's R row sums reduced across the warp in 5 shuffle rounds together
//   (xreduce: R - 1 + 5 - log2 R shuffles, not 5 R), and stage B's o projection (K = 128: one
//   column pass, then the reductions) R = 8 rows a warp, not 4.
// OPT_KV_AHEAD (with OPT_PRODUCER): the producer also copies stage B's past K/V rows (its kv
//   head's, positions before the pass's own) into the stage's buffer beside the W_o slice, as
//   cp.async counted on the buffer's mbarrier, so stage B reads only its q, k, v after the
//   barrier. Those rows were written at least one pass (21 stages) earlier; the producer
//   issues at most NBUF - 1 stages ahead, after the stage threads released the buffer (its
//   mbarrier wait acquires what they had acquired at the grid barriers since).
// OPT_SPLIT_DOWN: stage D split by its input columns, not its output rows. A CTA multiplies
//   the act columns it computed in C (kept in shared memory) by those columns of W_d (stored
//   transposed, [L, I, H]: one contiguous slice) and adds its partial sums of all 1024 outputs
//   to d (atomics). C then needs no grid barrier and D reads no activations: 4 barriers a
//   layer become 3. d is zeroed in B (after every CTA read it in A or H), o in A (after D's
//   barrier: every CTA has read it in C); pass 0's last C and D are skipped (nothing reads
//   their output, and their reads would race the zeroing without a barrier after them).
constexpr int OPT_READ_FIRST = 1, OPT_TMA = 2, OPT_DIST1 = 4, OPT_PRODUCER = 8,
              OPT_COOPERATIVE = 16, OPT_TWO_TOKEN = 32, OPT_XREDUCE = 64, OPT_KV_AHEAD = 128,
              OPT_SPLIT_DOWN = 256;
// OPT_RAW (timing only, wrong results): the GEMVs use each FP8 weight word's bits as floats,
//   not converted (the loads stay, the FP8 -> f16x2 -> f32 conversions go): how much of a
//   stage's linear time the conversion takes.
constexpr int OPT_RAW = 1024;
// OPT_EARLY_FREE (with OPT_PRODUCER): a stage's buffer goes back to the producer as soon as
//   its CTA has arrived at the stage's grid barrier (thread 0, between its release add and its
//   polls), not at the next stage's top; so the copy into it (NBUF - 1 stages ahead) streams
//   while the CTA waits. The ncu profile of 2026-12-05 (H100): the barrier after A, the stage
//   during which the producer copies C's 48 KB, took twice the others (2.3 against 1.1 us),
//   and its release fence (MEMBAR.GPU, ERRBAR) held ~45 % of the samples of that wait: the
//   fence seems to wait for the CTA's copies in flight. Issued at the arrival, a copy has the
//   wait and the next stage's work to land before the next fence. Measured (H100 run 13):
//   A's barrier fell (2.31 -> 1.46 us) but B's, C's and D's weights came later: 6 % slower.
constexpr int OPT_EARLY_FREE = 2048;
// OPT_TAGGED: C's act and D's d as tagged words (a float's bits in the low half of a 64-bit
//   word, the writing stage's id + 1 in the high half, one relaxed 64-bit store each: single-
//   copy atomic), read by polling the words themselves: no grid barrier after C or D (2 of a
//   layer's 4), no release fence there, and the activation read is the wait (the profile:
//   each barrier ~1.1 us, then a dependent L2 read ~0.5 us). What the removed barriers also
//   ordered is kept by the barrier after B, which every CTA crosses once a layer (n below
//   counts layers over the passes):
//   - act and d are rewritten a layer later, by a CTA past the next barrier after B, which
//     every reader crossed after its read;
//   - o rotates over three buffers: B of layer n adds into o[n % 3] and C reads it; CTA 0
//     zeroes o[(n + 1) % 3] in B of layer n, before its barrier: that buffer's readers (C of
//     layer n - 2) crossed the barrier after B of layer n - 1, as CTA 0 did, and its next
//     writers (B of layer n + 1) come after this barrier.
//   The host zeroes act, d (qkv with OPT_TAGGED_QKV) and the o buffers at each launch, so no
//   word keeps a tag from the last frame (the same stage ids recur every frame). Not with
//   OPT_SPLIT_DOWN.
constexpr int OPT_TAGGED = 4096;
// OPT_TAGGED_QKV (with OPT_TAGGED): A's qkv tagged as well, so the barrier after A goes too:
//   B reads its head's q and its kv head's k and v (3 x 128 words a token, from ~12 CTAs) by
//   polling them. qkv is rewritten by A of the next layer, past the barrier after B, which
//   every reader crossed after its read. One grid barrier a layer is left (after B: o's
//   atomics), and the head's.
constexpr int OPT_TAGGED_QKV = 8192;
// OPT_WARP_QK: stage B's q/k RMSNorm and RoPE by one warp a vector (a token's q or k: a lane
//   holds dims lane + 32 m, m < 4, so the sum of squares is a warp sum and a dim's RoPE
//   partner, 64 away, is in the same lane): one block sync, not five a token (run 12's stamps:
//   B's norms and attention 1.56 us a stage).
constexpr int OPT_WARP_QK = 16384;
// OPT_GENERIC (host): the kernel compiled for any options, read from Params at run time (what
//   the bench's older variants run). Without it the options in SPECIALIZED (with the plain
//   grid barrier) run an instance compiled for exactly them: the generic full mode is 295 KB
//   of machine code against 132 KB for FETCH's own instance (sm_90a), and a persistent kernel
//   walks ~320 stages of it a frame (H100 run 11: FETCH 1.741 ms a frame in the generic
//   instance, 1.446 in its own; 1.487 in run 9, before the four options above existed).
constexpr int OPT_GENERIC = 512;
// FETCH: how the served options fetch (H100 runs 8-9); the served options add TWO_TOKEN and
// XREDUCE (run 11: 1.446 -> 1.368 ms a frame)
constexpr int FETCH = OPT_TMA | OPT_READ_FIRST | OPT_PRODUCER;
// The last: the served options with OPT_RAW (timing only), in an instance of its own so the
// conversion's share is timed against the served instance's code, not the generic one's.
// Then the served options with OPT_EARLY_FREE, with OPT_TAGGED, with both tagged options, with
// those and OPT_WARP_QK (the engine's default since H100 run 14), and with OPT_WARP_QK alone.
constexpr int SPECIALIZED[] = {FETCH | OPT_TWO_TOKEN | OPT_XREDUCE, FETCH, FETCH | OPT_TWO_TOKEN,
                               FETCH | OPT_XREDUCE,
                               FETCH | OPT_TWO_TOKEN | OPT_XREDUCE | OPT_RAW,
                               FETCH | OPT_TWO_TOKEN | OPT_XREDUCE | OPT_EARLY_FREE,
                               FETCH | OPT_TWO_TOKEN | OPT_XREDUCE | OPT_TAGGED,
                               FETCH | OPT_TWO_TOKEN | OPT_XREDUCE | OPT_TAGGED | OPT_TAGGED_QKV,
                               FETCH | OPT_TWO_TOKEN | OPT_XREDUCE | OPT_TAGGED | OPT_TAGGED_QKV |
                                   OPT_WARP_QK,
                               FETCH | OPT_TWO_TOKEN | OPT_XREDUCE | OPT_WARP_QK};

// The stages' threads only (named barrier 1): the producer warp never joins.
__device__ __forceinline__ void csync() { asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory"); }

struct Params {
    const uint8_t* wqkv; const float* sqkv;   // [L, 4096, 1024], [L, 4096]
    const uint8_t* wo; const float* so;       // [L, 16, 1024, 128] head-major, [L, 1024]
    const uint8_t* wgu; const float* sgu;     // [L, 6144, 1024] gate rows then up rows
    const uint8_t* wd; const float* sd;       // [L, 1024, 3072], [L, 1024]
    const uint8_t* whead; const float* shead; // [15, 2048, 1024], [15, 2048]
    int head_bytes;        // whead's bytes a weight: 1 (FP8) or 2 (bf16, shead all 1: the
                           // engine's own bf16 heads, not an FP8 copy of them)
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
    const uint8_t* wdt;    // [L, 3072, 1024]: W_d transposed (OPT_SPLIT_DOWN)
    unsigned* counter;     // zeroed before the launch: [1] (counting), [ctas] (flags) or
                           // [STRIPES * 32] (striped)
    int pace_ticks;        // producer (OPT_PRODUCER): 0, or its weight copies issued in
                           // pieces of PIECE bytes at least this many clock64 ticks apart
    int flag_barrier;      // 0: one counter (release add, acquire polls); 1: the same with
                           // full fences around it; 2: a word per CTA; 3: STRIPES
                           // counters (CTA c adds to c % STRIPES), each polled by a thread
    long long* stamps;     // null, or [2, STAGES, NSTAMP] clock64 of CTA 0 and the last CTA:
                           // the stage's top, the copy ahead issued, its weights ready, its
                           // activations read, its linear begun (norms, attention done),
                           // barrier arrival, barrier release
    int opts;              // OPT_* bits: how the stage's weights and activations are fetched
    int buf_bytes;         // one weight buffer's bytes (host: the largest stage slice)
    // sampling (ttsbuild.generation.sampling.sample), read from device memory at
    // element `row` (a SamplingBatch's tensors, the row's seed and frame index: a captured
    // graph replays with whatever they hold); a pass's draw counter is frame * 16 + codebook
    const bool* do_sample;          // false: greedy
    const long long* top_k;         // <= 0 or >= V: all tokens
    const float* temperature;
    const float* top_p;             // 1: off
    const long long* seed;
    const long long* frame;
    int row;
    float eps;
};

// n * cta < 2^31 (n <= 4096, cta <= 132): a 32-bit division (a 64-bit one is a ~60-instruction
// routine inlined at every call)
__host__ __device__ __forceinline__ int rows_begin(int n, int cta, int ctas) {
    return (int)((unsigned)(n * cta) / (unsigned)ctas);
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

// OPT_KV_AHEAD: where stage B's past K rows start in its buffer (after the W_o slice, FP8
// bytes), its V rows (G - 1) * HD floats after them; the bytes they need at most
__host__ __device__ __forceinline__ int kv_offset(int cta, int ctas) {
    const Rows w = stage_rows(1, cta, ctas);
    return ((w.r1 - w.r0) * HD + 15) / 16 * 16;
}
constexpr int KV_AHEAD_BYTES = 2 * (G - 1) * HD * (int)sizeof(float);

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
// after_arrive: run by thread 0 between its arrival and its polls (OPT_EARLY_FREE)
template <bool FENCED, typename AfterArrive>
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target,
                                             AfterArrive after_arrive) {
    csync();
    if (threadIdx.x == 0) {
        if (FENCED) __threadfence();
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counter) : "memory");
        after_arrive();
        unsigned v;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
            if (++spins > (1ll << 22)) __trap();  // a CTA never arrived (~seconds): fail, never hang
        } while (v < target);
        if (FENCED) __threadfence();
    }
    csync();
}

// The counter split in STRIPES (a 128-byte line each): CTA c adds to stripe c % STRIPES, so
// 132 same-address atomics become ~17 on each of 8 lines; thread j of every CTA polls stripe
// j until it holds its CTAs' arrivals.
constexpr int STRIPES = 8;
__device__ __forceinline__ void grid_barrier_striped(unsigned* counter, unsigned epoch, int ctas) {
    csync();
    if (threadIdx.x == 0)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n"
                     ::"l"(counter + 32 * (blockIdx.x % STRIPES)) : "memory");
    if (threadIdx.x < STRIPES) {
        const int j = threadIdx.x;
        const unsigned target = epoch * (unsigned)(ctas / STRIPES + (j < ctas % STRIPES ? 1 : 0));
        unsigned v;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n"
                         : "=r"(v) : "l"(counter + 32 * j) : "memory");
            if (++spins > (1ll << 22)) __trap();
        } while (v < target);
    }
    csync();
}

// The same barrier without an atomic: each CTA stores the barrier's number to its own word
// (release) and threads 0..ctas-1 of every CTA wait for one word each (acquire). No arrivals
// serialise on one address; the words of 132 CTAs lie in five 128-byte lines.
__device__ __forceinline__ void grid_barrier_flags(unsigned* flags, unsigned epoch, int ctas) {
    csync();
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
    csync();
}

// tokens in pass `pass` (2: OPT_TWO_TOKEN's pass 1, positions 0 and 1; else 1, at `pass`)
__device__ __forceinline__ int tokens_of(bool two, int pass) { return two && pass == 1 ? 2 : 1; }

// stage index -> (pass, r): r 0..19 = layer r/4, kind r%4 (A, B, C, D); r 20 = head
__device__ __forceinline__ void stage_of(int sid, int& pass, int& r) {
    if (sid < 20) { pass = 0; r = sid; }
    else { pass = 1 + (sid - 20) / 21; r = (sid - 20) % 21; }
}

// Small vectors, 16 or 4 bytes a request (thread t of nt issues its share).
__device__ __forceinline__ void copy_vec(float* dst, const float* src, int n, int t, int nt) {
    for (int i = t; i < n / 4; i += nt) cp_async16(dst + 4 * i, src + 4 * i);  // n % 4 == 0
}
__device__ __forceinline__ void copy_rows(float* dst, const float* src, int n, int t, int nt) {
    for (int i = t; i < n; i += nt) cp_async4(dst + i, src + i);  // 4 B each
}

// The small vectors a stage reads, copied beside its weights (side, SIDE floats):
//   A: input norm [0, 1024), qkv scales [1024, ...)      C: post norm, gate scales, up scales
//   B: q norm [0, 128), k norm [128, 256), cos [256, 320), sin [320, 384), o scales [384, ...)
//   D: down scales [0, ...)                              H: final norm, head scales
__device__ void issue_side(const Params& p, int pass, int r, float* side, int cta, int ctas,
                           int t, int nt, bool split) {
    const Rows w = stage_rows(r == 20 ? 4 : r % 4, cta, ctas);
    const int r0 = w.r0, r1 = w.r1;
    if (r == 20) {
        copy_vec(side, p.final_norm, H, t, nt);
        copy_rows(side + H, p.shead + (size_t)(pass - 1) * V + r0, r1 - r0, t, nt);
        return;
    }
    const int l = r / 4, kind = r % 4;
    if (kind == 0) {
        copy_vec(side, p.in_norm + l * H, H, t, nt);
        copy_rows(side + H, p.sqkv + l * QKV + r0, r1 - r0, t, nt);
    } else if (kind == 1) {
        copy_vec(side, p.q_norm + l * HD, HD, t, nt);
        copy_vec(side + HD, p.k_norm + l * HD, HD, t, nt);
        copy_vec(side + 2 * HD, p.rope_cos + pass * (HD / 2), HD / 2, t, nt);
        copy_vec(side + 2 * HD + HD / 2, p.rope_sin + pass * (HD / 2), HD / 2, t, nt);
        copy_rows(side + 3 * HD, p.so + l * H + r0, r1 - r0, t, nt);
    } else if (kind == 2) {
        copy_vec(side, p.post_norm + l * H, H, t, nt);
        copy_rows(side + H, p.sgu + (size_t)l * 2 * I + r0, r1 - r0, t, nt);
        copy_rows(side + H + (r1 - r0), p.sgu + (size_t)l * 2 * I + I + r0, r1 - r0, t, nt);
    } else if (split) {  // every output's scale: the CTA adds to all of d
        copy_vec(side, p.sd + l * H, H, t, nt);
    } else {
        copy_rows(side, p.sd + l * H + r0, r1 - r0, t, nt);
    }
}

// TMA bulk copies: one request a contiguous segment, completion counted in bytes on an mbarrier
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// an arrival on bar once this thread's earlier cp.async copies have landed (counted at init)
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
                 : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
                 "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
    unsigned done = 0;
    long long spins = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
        if (++spins > (1ll << 24)) __trap();
    }
}

// A stage's weight slice: n segments of `bytes`, the i-th from src + i * stride, laid end to
// end in the buffer.
struct Seg { const uint8_t* src; size_t stride; int n, bytes; };

__device__ Seg stage_segs(const Params& p, int pass, int r, int cta, int ctas, bool split) {
    const Rows w = stage_rows(r == 20 ? 4 : r % 4, cta, ctas);
    const int rows = w.r1 - w.r0;
    if (r == 20)
        return {p.whead + ((size_t)(pass - 1) * V + w.r0) * H * p.head_bytes, 0, 1,
                rows * H * p.head_bytes};
    const int l = r / 4, kind = r % 4;
    if (kind == 0) return {p.wqkv + ((size_t)l * QKV + w.r0) * H, 0, 1, rows * H};
    if (kind == 1)  // W_o[r0:r1, h*128:(h+1)*128] of head h = cta % NH: one segment, W_o stored
                    // head-major ahead of time (row-major, it was a segment a row: 128 TMA
                    // requests of 128 B, ~5 us to issue on the H100, 2026-12-05)
        return {p.wo + (((size_t)l * NH + cta % NH) * H + w.r0) * HD, 0, 1, rows * HD};
    if (kind == 2)  // gate rows r0..r1, then up rows r0..r1
        return {p.wgu + ((size_t)l * 2 * I + w.r0) * H, (size_t)I * H, 2, rows * H};
    if (split) {  // W_d's columns j0..j1 of C's split, transposed: one slice
        const Rows c = stage_rows(2, cta, ctas);
        return {p.wdt + ((size_t)l * I + c.r0) * H, 0, 1, (c.r1 - c.r0) * H};
    }
    return {p.wd + ((size_t)l * H + w.r0) * I, 0, 1, rows * I};
}

// A stage's weights as TMA bulk copies by one warp (lane 0..31), their bytes counted on bar.
// pace > 0 (the producer): lane 0 issues them in pieces of PIECE bytes at least pace clock64
// ticks apart, so a stage's latency-bound loads and barrier operations never queue behind a
// whole 48 KB copy.
constexpr int PIECE = 4096;
__device__ void issue_weights_tma(const Seg& g, uint8_t* buf, uint64_t* bar, int lane,
                                  int pace = 0) {
    if (lane == 0) {
        // the buffer's last reads (generic proxy) before the async proxy's writes
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_expect(bar, (unsigned)(g.n * g.bytes));
    }
    __syncwarp();
    if (pace > 0) {
        if (lane == 0) {
            long long t = clock64();
            for (int i = 0; i < g.n; ++i)
                for (int off = 0; off < g.bytes; off += PIECE) {
                    while (clock64() - t < pace) {}
                    t = clock64();
                    bulk_copy(buf + (size_t)i * g.bytes + off, g.src + i * g.stride + off,
                              (unsigned)min(PIECE, g.bytes - off), bar);
                }
        }
        __syncwarp();
        return;
    }
    for (int i = lane; i < g.n; i += 32)
        bulk_copy(buf + (size_t)i * g.bytes, g.src + i * g.stride, g.bytes, bar);
}

// Copy this CTA's weight slice of stage sid into buf, and its side vectors beside it (every
// stage thread calls it; with tma, warp 0 issues the bulk copies and bar counts their bytes).
__device__ void issue_stage(const Params& p, int sid, uint8_t* buf, int cta, int ctas, bool tma,
                            bool split, uint64_t* bar) {
    if (sid >= STAGES) return;
    int pass, r;
    stage_of(sid, pass, r);
    const int tid = threadIdx.x;
    issue_side(p, pass, r, reinterpret_cast<float*>(buf + p.buf_bytes), cta, ctas, tid, THREADS,
               split);
    const Seg g = stage_segs(p, pass, r, cta, ctas, split);
    if (tma) {
        if (tid < 32) issue_weights_tma(g, buf, bar, tid);
        return;
    }
    const int per = g.bytes / 16, chunks = g.n * per;
    for (int i = tid; i < chunks; i += THREADS) {
        const int seg = i / per, c = i % per;
        cp_async16(buf + (size_t)seg * g.bytes + c * 16, g.src + seg * g.stride + c * 16);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// OPT_TAGGED's words: tag << 32 | a float's bits, one relaxed 64-bit store (single-copy atomic)
__device__ __forceinline__ void st_tagged(unsigned long long* dst, float v, unsigned tag) {
    const unsigned long long w = ((unsigned long long)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;\n" ::"l"(dst), "l"(w) : "memory");
}

__device__ __forceinline__ void ld_tagged_pair(const unsigned long long* src,
                                               unsigned long long& a, unsigned long long& b) {
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];\n"
                 : "=l"(a), "=l"(b) : "l"(src) : "memory");
}

// np pairs of tagged words, pair j read from src_of(j) (16-byte aligned) into the two floats
// at dst_of(j) (added to them with ADD), pairs strided over the stage threads; every pair read
// again until both its tags are `tag`. The first loads all go out at once; then only pairs not
// yet written are read again, together. MAXP: pairs a thread at most (np <= MAXP * THREADS).
template <int MAXP, bool ADD, typename Src, typename Dst>
__device__ __forceinline__ void tagged_gather(int np, Src src_of, Dst dst_of, unsigned tag) {
    unsigned long long a[MAXP], b[MAXP];
#pragma unroll
    for (int k = 0; k < MAXP; ++k) {
        const int j = threadIdx.x + k * THREADS;
        if (j < np) ld_tagged_pair(src_of(j), a[k], b[k]);
    }
    long long spins = 0;
    for (;;) {
        bool done = true;
#pragma unroll
        for (int k = 0; k < MAXP; ++k) {
            const int j = threadIdx.x + k * THREADS;
            if (j < np && ((unsigned)(a[k] >> 32) != tag || (unsigned)(b[k] >> 32) != tag)) {
                ld_tagged_pair(src_of(j), a[k], b[k]);
                done = false;
            }
        }
        if (done) break;
        if (++spins > (1ll << 22)) __trap();  // a word never written (~seconds): fail, never hang
    }
#pragma unroll
    for (int k = 0; k < MAXP; ++k) {
        const int j = threadIdx.x + k * THREADS;
        if (j < np) {
            float* d = dst_of(j);
            const float u = __uint_as_float((unsigned)a[k]), v = __uint_as_float((unsigned)b[k]);
            d[0] = ADD ? d[0] + u : u;
            d[1] = ADD ? d[1] + v : v;
        }
    }
}

// n (even) tagged words from src into dst (dst[i] += their values with ADD, else =)
template <int MAXP, bool ADD>
__device__ __forceinline__ void tagged_read(const unsigned long long* src, float* dst, int n,
                                            unsigned tag) {
    tagged_gather<MAXP, ADD>(n / 2, [&](int j) { return src + 2 * j; },
                             [&](int j) { return dst + 2 * j; }, tag);
}

// OPT_TAGGED_QKV: B's q, k and v rows of nt tokens (3 nt segments of HD tagged words, from
// qkv_tag [nt, QKV]: head h's q, kv head g's k and v) into q, k, v (shared, nt rows of HD each)
__device__ __forceinline__ void tagged_read_qkv(const unsigned long long* qkv_tag, int nt,
                                                int h, int g, float* q, float* k, float* v,
                                                unsigned tag) {
    constexpr int PAIRS = HD / 2, MAXP = (3 * 2 * PAIRS + THREADS - 1) / THREADS;
    // pair j: segment j / PAIRS (token t = segment / 3, part q / k / v = segment % 3)
    auto part_of = [](int j) { return j / PAIRS % 3; };
    auto token_of = [](int j) { return j / PAIRS / 3; };
    auto word_of = [](int j) { return 2 * (j % PAIRS); };
    tagged_gather<MAXP, false>(
        3 * nt * PAIRS,
        [&](int j) {
            const int part = part_of(j);
            const int col = part == 0 ? h * HD                     // q of head h
                          : part == 1 ? NH * HD + g * HD           // k of kv head g
                                      : (NH + NKV) * HD + g * HD;  // v of kv head g
            return qkv_tag + (size_t)token_of(j) * QKV + col + word_of(j);
        },
        [&](int j) {
            const int part = part_of(j);
            return (part == 0 ? q : part == 1 ? k : v) + token_of(j) * HD + word_of(j);
        },
        tag);
}

// sum over the block of v (every thread gets it); red: WARPS floats of shared memory
__device__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    csync();
    if (lane == 0) red[w] = v;
    csync();
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
    csync();
}

// The sums over a warp of R values a lane (R a power of 2, <= 32), together: in each of the
// first log2 R rounds a lane keeps half of its values (the upper half where its lane bit, 16,
// 8, ..., is set), adding its partner's copy of that half; the value left is then summed over
// the remaining lane bits. Row i's total ends in lanes i * 32 / R .. (i + 1) * 32 / R - 1
// (lane >> (5 - log2 R) == i). R - 1 + 5 - log2 R shuffles, against 5 R for a warp_sum a row.
template <int R>
__device__ __forceinline__ float xreduce(float (&s)[R], int lane) {
    int o = 16;
#pragma unroll
    for (int n = R; n > 1; n >>= 1, o >>= 1) {
        const bool upper = lane & o;
#pragma unroll
        for (int i = 0; i < n / 2; ++i) {
            const float send = upper ? s[i] : s[i + n / 2];
            const float keep = upper ? s[i + n / 2] : s[i];
            s[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    float v = s[0];
#pragma unroll
    for (; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A GEMV's switches (`how`): GEMV_XR, the row sums reduced together (OPT_XREDUCE); GEMV_RAW,
// the weight words' bits as floats, unconverted (OPT_RAW, timing only)
constexpr int GEMV_XR = 1, GEMV_RAW = 2;

// Four consecutive bf16 weights (8 bytes) as floats: a bf16 is a float's upper 16 bits
__device__ __forceinline__ float4 bf16x4_to_float4(const uint8_t* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

// A lane's partial sums of rows r0 .. r0 + R - 1 (a missing row repeats the last) for T token
// rows: columns 4 lane + 128 (KS j + kp), j = 0, 1, ... (gemv_tok below). BF16: the weights
// are bf16 (2 bytes each; a lane's 4 columns one 8-byte word), else FP8 e4m3.
template <int R, int T, int KS, bool BF16 = false>
__device__ __forceinline__ void gemv_sums(const uint8_t* w, int rows, int K, const float* x,
                                          int xs, bool raw, int r0, int kp, int lane,
                                          float (&s)[T][R]) {
    constexpr int WB = BF16 ? 2 : 1;  // bytes a weight
    const uint8_t* wr[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
        wr[i] = w + (size_t)min(r0 + i, rows - 1) * K * WB;
#pragma unroll
        for (int t = 0; t < T; ++t) s[t][i] = 0.f;
    }
#pragma unroll 4
    for (int k = 4 * lane + 128 * kp; k < K; k += 128 * KS) {
        float4 a[T];
#pragma unroll
        for (int t = 0; t < T; ++t) a[t] = *reinterpret_cast<const float4*>(x + t * xs + k);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            float4 f;
            if constexpr (BF16) {
                f = bf16x4_to_float4(wr[i] + 2 * k);
            } else {
                __nv_fp8x4_e4m3 q;
                q.__x = *reinterpret_cast<const uint32_t*>(wr[i] + k);
                const float raw_f = __uint_as_float(q.__x);
                f = raw ? make_float4(raw_f, raw_f, raw_f, raw_f) : static_cast<float4>(q);
            }
#pragma unroll
            for (int t = 0; t < T; ++t)
                s[t][i] += f.x * a[t].x + f.y * a[t].y + f.z * a[t].z + f.w * a[t].w;
        }
    }
}

// rows x K FP8 (BF16: bf16) weights in shared memory (row-major, K % 128 == 0) times x
// (shared, K floats):
// R rows a warp at once, lane l on columns 4l + 128j (a 4-byte weight word and a float4 of x:
// a warp's reads are contiguous, no bank conflicts; x is read once for the R rows). (The first
// version gave a lane 16 consecutive columns: its x reads, 64 bytes apart across lanes, took 4x
// the shared-memory wavefronts, and x was read anew for every row: ~2-3 us a stage on the
// H100, 2026-12-05.) T token rows at once (x: T rows xs floats apart; OPT_TWO_TOKEN): each
// weight word is read once for the T rows, and each row's sum runs in the same order as with
// T = 1. out(t, row, sum), called by lane row % R, or with GEMV_XR in `how` (OPT_XREDUCE: the
// R rows' warp sums by xreduce) by the first lane holding the row's total.
// KS > 1: KS warps a row group, each on every KS-th 128-column block (lane l on 4l + 128 (KS j
// + part)); parts 1..KS-1 leave their sums in `part` (shared, (KS - 1) T rows floats), and part
// 0 adds them (in part order) before out. Needs rows <= WARPS / KS * R (one round) and every
// stage thread calling (a block sync inside).
template <int R, int T, int KS = 1, bool BF16 = false, typename Out>
__device__ void gemv_tok(const uint8_t* w, int rows, int K, const float* x, int xs, int how,
                         Out out, float* part = nullptr) {
    const int w_id = threadIdx.x / 32 / KS, kp = threadIdx.x / 32 % KS, lane = threadIdx.x % 32;
    const bool xr = how & GEMV_XR, raw = how & GEMV_RAW;
    constexpr int GROUPS = WARPS / KS;
    static_assert(WARPS % KS == 0, "KS divides the warps");
    if (KS > 1) {  // parts 1..KS-1: their sums into part; part 0 adds them
        const int r0 = w_id * R;
        float s[T][R];
        if (r0 < rows) {
            gemv_sums<R, T, KS, BF16>(w, rows, K, x, xs, raw, r0, kp, lane, s);
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int i = 0; i < R; ++i) s[t][i] = warp_sum(s[t][i]);
            if (kp > 0 && lane == 0)
#pragma unroll
                for (int t = 0; t < T; ++t)
#pragma unroll
                    for (int i = 0; i < R; ++i)
                        if (r0 + i < rows) part[((kp - 1) * T + t) * rows + r0 + i] = s[t][i];
        }
        csync();
        if (r0 < rows && kp == 0 && lane < R && r0 + lane < rows) {
#pragma unroll
            for (int t = 0; t < T; ++t) {
                float v = 0.f;
#pragma unroll
                for (int i = 0; i < R; ++i) if (lane == i) v = s[t][i];
                for (int q = 1; q < KS; ++q) v += part[((q - 1) * T + t) * rows + r0 + lane];
                out(t, r0 + lane, v);
            }
        }
        csync();  // part is free again
        return;
    }
    for (int r0 = w_id * R; r0 < rows; r0 += GROUPS * R) {  // warp-uniform
        float s[T][R];
        gemv_sums<R, T, 1, BF16>(w, rows, K, x, xs, raw, r0, 0, lane, s);
        if (xr) {
            constexpr int g = 32 / R;  // lanes holding a row's total; the first one writes it
#pragma unroll
            for (int t = 0; t < T; ++t) {
                const float v = xreduce<R>(s[t], lane);
                if (lane % g == 0 && r0 + lane / g < rows) out(t, r0 + lane / g, v);
            }
            continue;
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
            float mine = 0.f;  // lane i writes row r0 + i: the R stores (atomics in B) side by side
#pragma unroll
            for (int i = 0; i < R; ++i) {
                const float v = warp_sum(s[t][i]);
                if (lane == i) mine = v;
            }
            if (lane < R && r0 + lane < rows) out(t, r0 + lane, mine);
        }
    }
}

// nt (1 or 2) token rows
template <int R, int KS = 1, typename Out>
__device__ void gemv_rows(const uint8_t* w, int rows, int K, const float* x, int xs, int nt,
                          int how, Out out, float* part = nullptr) {
    if (nt == 2) gemv_tok<R, 2, KS>(w, rows, K, x, xs, how, out, part);
    else gemv_tok<R, 1, KS>(w, rows, K, x, xs, how, out, part);
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
    csync();
    if (threadIdx.x % 32 == 0) { red[threadIdx.x / 32] = best; ired[threadIdx.x / 32] = arg; }
    csync();
    best = red[0]; arg = ired[0];
    for (int i = 1; i < WARPS; ++i)
        if (red[i] > best || (red[i] == best && ired[i] < arg)) { best = red[i]; arg = ired[i]; }
    csync();
}

__device__ int block_total(int n, int* ired) {  // sum of n over the block
    for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
    csync();
    if (threadIdx.x % 32 == 0) ired[threadIdx.x / 32] = n;
    csync();
    int t = 0;
    for (int i = 0; i < WARPS; ++i) t += ired[i];
    csync();
    return t;
}

// The largest order key t with at least k of the v (spread over the block, PER a thread) at or
// above it: the k-th largest's key, found bit by bit (32 counts).
template <int PER>
__device__ uint32_t kth_key(const float (&v)[PER], int k, int* ired) {
    uint32_t t = 0;
    for (int b = 31; b >= 0; --b) {
        const uint32_t cand = t | (1u << b);
        int mine = 0;
#pragma unroll
        for (int j = 0; j < PER; ++j) mine += order_key(v[j]) >= cand;
        if (block_total(mine, ired) >= k) t = cand;
    }
    return t;
}

// The token of one pass from its logits (global, V), as sampling.sample: greedy, or Gumbel-max
// over logits / temperature kept by top-k (ties with the k-th kept) and then top-p (on what
// top-k kept, ascending, tokens are dropped while their cumulative probability stays <= 1 - p;
// the most probable is always kept, ties with the threshold too).
// top-k alone: the winner over all tokens is the winner over the kept ones whenever it is kept
// (fewer than k tokens above it), so the common case costs one count; otherwise the k-th
// largest is found bit by bit. top-p (rows with top_p < 1): the kept set's smallest key is the
// largest t whose mass below it is <= (1 - p) of the kept mass, found bit by bit (32 sums).
__device__ int pick_token(const float* lg, bool do_sample, int top_k, float top_p,
                          float temperature, long long seed, long long counter, float* red,
                          int* ired) {
    constexpr int PER = V / THREADS;
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) v[j] = __ldcg(lg + threadIdx.x + j * THREADS);
    float best = -INFINITY;
    int arg = 0;
    if (!do_sample) {
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (v[j] > best) { best = v[j]; arg = threadIdx.x + j * THREADS; }
        block_argmax(best, arg, red, ired);
        return arg;
    }
    const uint32_t stream = noise_stream(seed, counter);
    float z[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        v[j] = v[j] / temperature;
        z[j] = v[j] + gumbel(stream, threadIdx.x + j * THREADS);
        if (z[j] > best) { best = z[j]; arg = threadIdx.x + j * THREADS; }
    }
    block_argmax(best, arg, red, ired);
    const bool use_k = top_k > 0 && top_k < V, use_p = top_p < 1.f;
    if (!use_k && !use_p) return arg;
    uint32_t keep = 0;  // tokens with order_key(v) >= keep are kept
    if (!use_p) {
        // the winner's scaled logit: from the thread that holds it
        __shared__ float s_w;
        if (arg % THREADS == (int)threadIdx.x) s_w = v[arg / THREADS];
        csync();
        const float sw = s_w;
        int mine = 0;
#pragma unroll
        for (int j = 0; j < PER; ++j) mine += v[j] > sw;
        if (block_total(mine, ired) < top_k) return arg;
        keep = kth_key(v, top_k, ired);
    } else {
        if (use_k) keep = kth_key(v, top_k, ired);
        float vmax = -INFINITY;
        int imax = 0;
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (v[j] > vmax) { vmax = v[j]; imax = threadIdx.x + j * THREADS; }
        block_argmax(vmax, imax, red, ired);
        float e[PER], mine = 0.f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            e[j] = order_key(v[j]) >= keep ? expf(v[j] - vmax) : 0.f;
            mine += e[j];
        }
        const float budget = (1.f - top_p) * block_sum(mine, red);
        uint32_t t = 0;
        for (int b = 31; b >= 0; --b) {
            const uint32_t cand = t | (1u << b);
            float below = 0.f;
#pragma unroll
            for (int j = 0; j < PER; ++j) below += order_key(v[j]) < cand ? e[j] : 0.f;
            if (block_sum(below, red) <= budget) t = cand;
        }
        keep = t > keep ? t : keep;
    }
    best = -INFINITY; arg = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j)
        if (order_key(v[j]) >= keep && z[j] > best) { best = z[j]; arg = threadIdx.x + j * THREADS; }
    block_argmax(best, arg, red, ired);
    return arg;
}

// FIXED: the options this instance was compiled for (one of SPECIALIZED), or -1: p.opts's,
// read at run time (OPT_GENERIC)
template <int MODE, int FIXED>
__global__ void __launch_bounds__(BLOCK, 1) cp_megaframe_kernel(Params p) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int opts = FIXED >= 0 ? FIXED : p.opts;
    // the barrier's variant: an instance compiled for its options has the plain one only
    const int flag_barrier = FIXED >= 0 ? 0 : p.flag_barrier;
    const bool two = opts & OPT_TWO_TOKEN, xr = opts & OPT_XREDUCE;
    const int how = (xr ? GEMV_XR : 0) | ((opts & OPT_RAW) ? GEMV_RAW : 0);  // GEMV switches
    const bool split = opts & OPT_SPLIT_DOWN;
    const bool tagged = (opts & OPT_TAGGED) && !split;  // the host refuses the two together
    const bool tagged_qkv = tagged && (opts & OPT_TAGGED_QKV);
    unsigned long long* const qkv_tag = reinterpret_cast<unsigned long long*>(p.qkv);  // [TT, QKV]
    unsigned long long* const d_tag = reinterpret_cast<unsigned long long*>(p.d);     // [TT, H]
    unsigned long long* const act_tag = reinterpret_cast<unsigned long long*>(p.act); // [TT, I]
    const int TT = two ? 2 : 1;   // token rows of the activation buffers (smem_bytes)
    uint8_t* wbuf = smem;                                             // NBUF x buf_bytes
    float* x = reinterpret_cast<float*>(smem + (size_t)NBUF * (p.buf_bytes + SIDE * 4));  // [TT, H]
    float* xn = x + TT * H;       // normed input / act [TT, I]
    float* qv = xn + TT * I;      // q [TT, 128]
    float* kv = qv + TT * HD;     // k [TT, 128]
    float* vv = kv + TT * HD;     // v [TT, 128]
    float* att = vv + TT * HD;    // attention out [TT, 128]
    float* sc = att + TT * HD;    // scores [TT, 16]
    float* red = sc + TT * 16;    // [WARPS]
    int* tok_s = reinterpret_cast<int*>(red + 2 * WARPS);
    float* kbuf = reinterpret_cast<float*>(tok_s + 2 * WARPS);  // [16, 128]: a head's past k
    float* vbuf = kbuf + G * HD;                                 // [16, 128]: ...and v

    const int cta = blockIdx.x, ctas = gridDim.x, tid = threadIdx.x;
    const bool tma = opts & OPT_TMA, read_first = opts & OPT_READ_FIRST;
    const bool do_sample = p.do_sample[p.row];
    const long long top_k_row = p.top_k[p.row];
    const int top_k = top_k_row > V ? V : (int)top_k_row;
    const float temperature = p.temperature[p.row], top_p = p.top_p[p.row];
    const long long seed = p.seed[p.row], counter_base = p.frame[p.row] * G;
    const bool producer = tma && (opts & OPT_PRODUCER) && (MODE == 0 || MODE == 3);
    const bool kv_ahead = producer && (opts & OPT_KV_AHEAD);
    const int dist = (opts & OPT_DIST1) ? 1 : 2;
    const size_t slot_bytes = (size_t)p.buf_bytes + SIDE * sizeof(float);
    // the first stage run: pass 1's first with OPT_TWO_TOKEN (pass 0's 20 stages skipped);
    // buffers and mbarrier phases count from it
    const int first = two ? 20 : 0;
    auto slot = [&](int sid) { return (sid - first) % NBUF; };
    auto phase = [&](int sid) { return ((sid - first) / NBUF) & 1; };
    auto buf_of = [&](int sid) { return wbuf + slot(sid) * slot_bytes; };
    // with tma: mbar[b], buffer b's copies landed (a phase a use: its bytes, and with the
    // producer also its 32 lanes' side copies); empty[b] (producer): the stage threads are
    // done with buffer b
    __shared__ uint64_t mbar[NBUF], empty[NBUF];
    if (tid == 0) {
        for (int i = 0; i < NBUF; ++i) {
            mbar_init(&mbar[i], producer ? 33 : 1);
            mbar_init(&empty[i], 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // the whole block, the producer warp too, once
    if (tid >= THREADS) {  // the producer warp: every stage's copies, NBUF stages ahead at most
        if (!producer) return;
        const int lane = tid - THREADS;
        for (int sid = first; sid < STAGES; ++sid) {
            const int b = slot(sid), k = sid - first;
            if (k >= NBUF) mbar_wait(&empty[b], ((k / NBUF) - 1) & 1);
            int pass, r;
            stage_of(sid, pass, r);
            uint8_t* buf = buf_of(sid);
            issue_side(p, pass, r, reinterpret_cast<float*>(buf + p.buf_bytes), cta, ctas, lane,
                       32, split);
            if (kv_ahead && r < 20 && r % 4 == 1) {  // B: its kv head's rows before the pass's
                const int l = r / 4, g = (cta % NH) / (NH / NKV);
                const int pos0 = pass + 1 - tokens_of(two, pass);
                float* kd = reinterpret_cast<float*>(buf + kv_offset(cta, ctas));
                const size_t at = ((size_t)(l * NKV + g) * G) * HD;
                copy_vec(kd, p.kcache + at, pos0 * HD, lane, 32);
                copy_vec(kd + (G - 1) * HD, p.vcache + at, pos0 * HD, lane, 32);
            }
            mbar_arrive_cp_async(&mbar[b]);
            issue_weights_tma(stage_segs(p, pass, r, cta, ctas, split), buf, &mbar[b], lane,
                              p.pace_ticks);
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // its side copies landed
        return;
    }
    unsigned barriers = 0;
    // OPT_EARLY_FREE: the stage whose buffer thread 0 gave back at its barrier (plain barrier)
    const bool early_free = producer && (opts & OPT_EARLY_FREE) && flag_barrier == 0;
    int freed = -1;
    long long* st = p.stamps && tid == 0 && (cta == 0 || cta == ctas - 1)
                        ? p.stamps + (size_t)(cta == 0 ? 0 : 1) * STAGES * NSTAMP : nullptr;
    int cur = 0;
    auto barrier = [&]() {
        ++barriers;
        csync();
        if (st) st[cur * NSTAMP + 5] = clock64();
        if (MODE != 3) {
            if (flag_barrier == 3) grid_barrier_striped(p.counter, barriers, ctas);
            else if (flag_barrier == 2) grid_barrier_flags(p.counter, barriers, ctas);
            else if (flag_barrier == 1) grid_barrier<true>(p.counter, barriers * ctas, [] {});
            else
                grid_barrier<false>(p.counter, barriers * ctas, [&] {
                    if (early_free) {  // the stage's threads are done with its buffer (csync)
                        mbar_arrive(&empty[slot(cur)]);
                        freed = cur;
                    }
                });
        }
        if (st) st[cur * NSTAMP + 6] = clock64();
    };
    // OPT_TAGGED's C and D (and A with OPT_TAGGED_QKV): no barrier; their stamps mark the
    // stage's end (arrival = release),
    // so the wait shows in the next stage's activation read
    auto untimed_barrier = [&]() {
        if (st) st[cur * NSTAMP + 5] = st[cur * NSTAMP + 6] = clock64();
    };
    auto issue = [&](int sid) {
        issue_stage(p, sid, buf_of(sid), cta, ctas, tma, split, &mbar[slot(sid)]);
        cp_commit();
    };
    int tok = 0;
    // A stage's input activations (written by other CTAs before the last barrier) into shared
    // memory, nt token rows from position pos0: A/H x (+= d, or the pass's input), B this
    // head's q, k, v and its kv head's rows before pos0, C x += o, D act.
    // o this stage adds into (B) or reads (C): with OPT_TAGGED o[layer % 3] (three buffers of
    // 2 H floats), set at each stage's top
    float* o_cur = p.o;
    auto read_input = [&](int l, int kind, int nt, int pos0) {
        if (kind == 0 || kind == 4) {
            if (kind == 0 && l == 0) {
                for (int t = 0; t < nt; ++t) {  // input q: 0 the hidden state, 1 c0, then codes
                    const int q = pos0 + t;
                    const float* src = q < 2 ? p.x_in + q * H
                                             : p.tables + ((size_t)(q - 2) * V + tok) * H;
                    for (int i = tid; i < H; i += THREADS) x[t * H + i] = __ldcg(src + i);
                }
            } else if (tagged) {  // d as D (the stage before) tagged it: cur
                tagged_read<(2 * H / 2 + THREADS - 1) / THREADS, true>(d_tag, x, nt * H,
                                                                       (unsigned)cur);
            } else {
                for (int i = tid; i < nt * H; i += THREADS) x[i] += __ldcg(p.d + i);
            }
        } else if (kind == 1) {
            const int h = cta % NH, g = h / (NH / NKV);
            if (tagged_qkv) {  // as A (the stage before) tagged them: cur
                tagged_read_qkv(qkv_tag, nt, h, g, qv, kv, vv, (unsigned)cur);
            } else if (tid < HD) {
                for (int t = 0; t < nt; ++t) {
                    const float* row = p.qkv + t * QKV;
                    qv[t * HD + tid] = __ldcg(row + h * HD + tid);
                    kv[t * HD + tid] = __ldcg(row + NH * HD + g * HD + tid);
                    vv[t * HD + tid] = __ldcg(row + (NH + NKV) * HD + g * HD + tid);
                }
            }
            const float* kc = p.kcache + ((size_t)(l * NKV + g) * G) * HD;
            const float* vc = p.vcache + ((size_t)(l * NKV + g) * G) * HD;
            for (int i = tid; !kv_ahead && i < pos0 * HD / 4; i += THREADS) {  // past rows, one
                // batch of loads (with OPT_KV_AHEAD the producer copied them beside the weights)
                reinterpret_cast<float4*>(kbuf)[i] = __ldcg(reinterpret_cast<const float4*>(kc) + i);
                reinterpret_cast<float4*>(vbuf)[i] = __ldcg(reinterpret_cast<const float4*>(vc) + i);
            }
        } else if (kind == 2) {
            for (int i = tid; i < nt * H; i += THREADS) x[i] += __ldcg(o_cur + i);
        } else if (tagged) {  // act as C (the stage before) tagged it: cur
            tagged_read<(2 * I / 2 + THREADS - 1) / THREADS, false>(act_tag, xn, nt * I,
                                                                    (unsigned)cur);
        } else {
            for (int i = tid; i < nt * I; i += THREADS) xn[i] = __ldcg(p.act + i);
        }
        csync();
    };

    if ((MODE == 0 || MODE == 3) && !producer) {  // prologue: the first `dist` stages in flight
        for (int i = 0; i < dist; ++i) issue(first + i);
    }
    for (int sid = first; sid < STAGES; ++sid) {
        int pass, r;
        stage_of(sid, pass, r);
        const int nt = tokens_of(two, pass), pos0 = pass + 1 - nt;  // its first token's position
        if (MODE == 1) {
            if (!(pass == 0 && r == 19)) barrier();
            continue;
        }
        const int l = r / 4, kind = r == 20 ? 4 : r % 4;
        if (tagged) o_cur = p.o + (size_t)((pass * L + l) % 3) * 2 * H;
        // OPT_SPLIT_DOWN: pass 0's last C and D do nothing (their buffers still cycle)
        const bool idle = split && pass == 0 && l == L - 1 && (kind == 2 || kind == 3);
        uint8_t* wb = buf_of(sid);
        csync();  // the buffer refilled next was an earlier stage's: all warps done
        if (producer && tid == 0 && sid > first && freed != sid - 1)
            mbar_arrive(&empty[slot(sid - 1)]);
        cur = sid;
        if (st) st[sid * NSTAMP] = clock64();
        long long t_act = 0;
        const bool reads = !idle && !(split && kind == 3);  // split D: its act is on chip
        if (read_first && reads) {
            read_input(l, kind, nt, pos0);
            if (st) t_act = clock64();
        }
        if (!producer) issue(MODE == 2 ? sid : sid + dist);
        if (st) st[sid * NSTAMP + 1] = clock64();
        if (producer) ;  // its copies counted on mbar
        else if (MODE == 2) cp_wait<0>();
        else if (dist == 2) cp_wait<2>();
        else cp_wait<1>();
        if (tma) mbar_wait(&mbar[slot(sid)], phase(sid));
        csync();
        if (st) st[sid * NSTAMP + 2] = clock64();
        if (!read_first && reads) {
            read_input(l, kind, nt, pos0);
            if (st) t_act = clock64();
        }
        if (idle) continue;
        if (st) st[sid * NSTAMP + 3] = t_act;
        const float* side = reinterpret_cast<const float*>(wb + p.buf_bytes);
        if (kind == 0) {
            for (int t = 0; t < nt; ++t) rms_norm(x + t * H, side, xn + t * H, p.eps, red);
            const auto [r0, r1] = stage_rows(0, cta, ctas);
            const float* s = side + H;
            float* y = p.qkv + r0;
            unsigned long long* yt = qkv_tag + r0;  // OPT_TAGGED_QKV's words of the same rows
            if (st) st[sid * NSTAMP + 4] = clock64();
            gemv_rows<RA>(wb, r1 - r0, H, xn, H, nt, how, [&](int t, int i, float v) {
                if (tagged_qkv) st_tagged(yt + t * QKV + i, v * s[i], (unsigned)cur + 1);
                else __stcg(y + t * QKV + i, v * s[i]);
            });
            if (split && cta == 0)  // every CTA read o in C before D's barrier: zero it for B
                for (int i = tid; i < TT * H; i += THREADS) __stcg(p.o + i, 0.f);
            if (tagged_qkv) untimed_barrier();  // B polls its head's rows
            else barrier();
        } else if (kind == 1) {
            const int h = cta % NH, g = h / (NH / NKV);
            // q/k RMSNorm over the head (warps 0-3: q; 4-7: k), then RoPE (rotate-half) at the
            // token's position: the side holds position `pass`'s cos and sin; OPT_TWO_TOKEN's
            // token at position 0 skips the rotation (the identity there: cos 1, sin 0)
            // (threads from 2 HD on, with 512 stage threads, only join the block syncs)
            const bool qk = tid < 2 * HD;
            if (opts & OPT_WARP_QK) {  // warp 2 t + 0: token t's q, 2 t + 1: its k
                const int w_id = tid / 32, lane = tid % 32;
                if (w_id < 2 * nt) {
                    const int tk = w_id / 2;
                    const bool isq = w_id % 2 == 0, rotate = pos0 + tk == pass;
                    float* t = (isq ? qv : kv) + tk * HD;
                    const float* wn = side + (isq ? 0 : HD);
                    float v[4], ss = 0.f;
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        v[m] = t[lane + 32 * m];
                        ss += v[m] * v[m];
                    }
                    const float rstd = rsqrtf(warp_sum(ss) / HD + p.eps);
#pragma unroll
                    for (int m = 0; m < 4; ++m) v[m] = v[m] * rstd * wn[lane + 32 * m];
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        const int d0 = lane + 32 * m, f = d0 % (HD / 2);
                        const float rot = m < 2 ? -v[m + 2] : v[m - 2];
                        t[d0] = rotate ? v[m] * side[2 * HD + f] + rot * side[2 * HD + HD / 2 + f]
                                       : v[m];
                    }
                }
                csync();
            }
            for (int tk = 0; tk < nt && !(opts & OPT_WARP_QK); ++tk) {
                const bool rotate = pos0 + tk == pass;
                float* t = (tid < HD ? qv : kv) + tk * HD;
                const int d0 = tid % HD;
                float v = qk ? t[d0] * t[d0] : 0.f;
                v = warp_sum(v);
                if (qk && tid % 32 == 0) red[tid / 32] = v;
                csync();
                const int base = tid < HD ? 0 : 4;
                float ss = red[base] + red[base + 1] + red[base + 2] + red[base + 3];
                float rstd = rsqrtf(ss / HD + p.eps);
                const float* wn = side + (tid < HD ? 0 : HD);
                float nv = qk ? t[d0] * rstd * wn[d0] : 0.f;
                csync();
                if (qk) t[d0] = nv;
                csync();
                if (rotate) {
                    const int f = d0 % (HD / 2);
                    float c = side[2 * HD + f], sn = side[2 * HD + HD / 2 + f];
                    float rot = d0 < HD / 2 ? -t[d0 + HD / 2] : t[d0 - HD / 2];
                    float outv = t[d0] * c + rot * sn;
                    csync();
                    if (qk) t[d0] = outv;
                    csync();
                }
            }
            float* kc = p.kcache + ((size_t)(l * NKV + g) * G) * HD;
            float* vc = p.vcache + ((size_t)(l * NKV + g) * G) * HD;
            if (cta < NH && h % (NH / NKV) == 0 && tid < HD) {  // one writer per kv head
                for (int t = 0; t < nt; ++t) {
                    __stcg(kc + (pos0 + t) * HD + tid, kv[t * HD + tid]);
                    __stcg(vc + (pos0 + t) * HD + tid, vv[t * HD + tid]);
                }
            }
            // token t at position pos0 + t attends to positions 0..pos0 + t: those before pos0
            // from the cache rows read (or copied beside the weights), the pass's own from k, v
            const float* kp = kv_ahead ? reinterpret_cast<const float*>(wb + kv_offset(cta, ctas))
                                       : kbuf;
            const float* vp = kv_ahead ? kp + (G - 1) * HD : vbuf;
            const int w_id = tid / 32, lane = tid % 32;
            for (int t = 0; t < nt; ++t) {
                const int pos = pos0 + t;
                for (int j = w_id; j <= pos; j += WARPS) {
                    float s = 0.f;
                    for (int d0 = lane; d0 < HD; d0 += 32)
                        s += qv[t * HD + d0] *
                             (j >= pos0 ? kv[(j - pos0) * HD + d0] : kp[j * HD + d0]);
                    s = warp_sum(s);
                    if (lane == 0) sc[t * 16 + j] = s * rsqrtf((float)HD);
                }
            }
            csync();
            if (tid < HD) {
                for (int t = 0; t < nt; ++t) {
                    const int pos = pos0 + t;
                    const float* st_ = sc + t * 16;
                    float m = -INFINITY;
                    for (int j = 0; j <= pos; ++j) m = fmaxf(m, st_[j]);
                    float den = 0.f, acc = 0.f;
                    for (int j = 0; j <= pos; ++j) {
                        float e = __expf(st_[j] - m);
                        den += e;
                        acc += e * (j >= pos0 ? vv[(j - pos0) * HD + tid] : vp[j * HD + tid]);
                    }
                    att[t * HD + tid] = acc / den;
                }
            }
            csync();
            const Rows ow = stage_rows(1, cta, ctas);
            const int o0 = ow.r0, o1 = ow.r1;
            const float* so = side + 3 * HD;
            if (st) st[sid * NSTAMP + 4] = clock64();
            if (split && cta == 0)  // every CTA read d in A or H before A's barrier: zero it for D
                for (int i = tid; i < TT * H; i += THREADS) __stcg(p.d + i, 0.f);
            auto add_o = [&](int t, int i, float v) { atomicAdd(o_cur + t * H + o0 + i, v * so[i]); };
            if (xr) gemv_rows<8>(wb, o1 - o0, HD, att, HD, nt, how, add_o);
            else gemv_rows<4>(wb, o1 - o0, HD, att, HD, nt, how, add_o);
            if (tagged && cta == 0) {  // o[(layer + 1) % 3] for the next B (OPT_TAGGED)
                float* o_next = p.o + (size_t)((pass * L + l + 1) % 3) * 2 * H;
                for (int i = tid; i < TT * H; i += THREADS) __stcg(o_next + i, 0.f);
            }
            barrier();
        } else if (kind == 2) {
            for (int t = 0; t < nt; ++t) rms_norm(x + t * H, side, xn + t * H, p.eps, red);
            const auto [j0, j1] = stage_rows(2, cta, ctas);
            const int n = j1 - j0;
            const float* sg = side + H;
            const float* su = sg + n;
            // the buffer is [2n, H]: gate rows then up rows; their sums beside xn (2n a token
            // row), then silu(gate) * up of each column
            float* gu = xn + TT * H;
            if (st) st[sid * NSTAMP + 4] = clock64();
            gemv_rows<2>(wb, 2 * n, H, xn, H, nt, how,
                         [&](int t, int i, float v) { gu[t * 2 * n + i] = v; });
            csync();
            if (tid < n) {
                for (int t = 0; t < nt; ++t) {
                    const float* g_ = gu + t * 2 * n;
                    const float a = g_[tid] * sg[tid], b = g_[n + tid] * su[tid];
                    const float act = a / (1.f + __expf(-a)) * b;
                    if (split) att[t * HD + tid] = act;  // D's input, this CTA's columns
                    else if (tagged) st_tagged(act_tag + t * I + j0 + tid, act, (unsigned)cur + 1);
                    else __stcg(p.act + t * I + j0 + tid, act);
                }
            }
            if (tagged) untimed_barrier();
            else if (!split) barrier();
        } else if (kind == 3 && split) {
            // d += W_d[:, j0:j1] act[j0:j1] over this CTA's columns (C's), every output: thread
            // tid has outputs 4 tid .. 4 tid + 3 (H = 4 x THREADS), a 4-byte word a column row
            const auto [j0, j1] = stage_rows(2, cta, ctas);
            const int n = j1 - j0;
            if (st) st[sid * NSTAMP + 4] = clock64();
            float acc[2][4] = {};
            for (int j = 0; j < n; ++j) {
                __nv_fp8x4_e4m3 q;
                q.__x = *reinterpret_cast<const uint32_t*>(wb + (size_t)j * H + 4 * tid);
                const float4 f = static_cast<float4>(q);
                for (int t = 0; t < nt; ++t) {
                    const float a = att[t * HD + j];
                    acc[t][0] += f.x * a; acc[t][1] += f.y * a;
                    acc[t][2] += f.z * a; acc[t][3] += f.w * a;
                }
            }
            for (int t = 0; t < nt; ++t)
                for (int i = 0; i < 4; ++i)
                    atomicAdd(p.d + t * H + 4 * tid + i, acc[t][i] * side[4 * tid + i]);
            barrier();
        } else if (kind == 3) {
            const auto [r0, r1] = stage_rows(3, cta, ctas);
            const float* s = side;
            float* y = p.d + r0;
            unsigned long long* yt = d_tag + r0;  // OPT_TAGGED's words of the same rows
            if (st) st[sid * NSTAMP + 4] = clock64();
            gemv_rows<1, KSD>(wb, r1 - r0, I, xn, I, nt, how,
                              [&](int t, int i, float v) {
                                  if (tagged) st_tagged(yt + t * H + i, v * s[i],
                                                        (unsigned)cur + 1);
                                  else __stcg(y + t * H + i, v * s[i]);
                              },
                              sc);  // KSD > 1: the parts' sums in the scores' space (B's)
            if (tagged) {  // o rotates by layer (B zeroes the next one)
                untimed_barrier();
            } else {
                if (cta == 0)  // every CTA read o in C (before the last barrier): zero it for B
                    for (int i = tid; i < nt * H; i += THREADS) __stcg(p.o + i, 0.f);
                if (!(pass == 0 && l == L - 1)) barrier();  // pass 0 has no head: nothing reads d
            }
        } else {  // head of codebook `pass` (its last token's row), then every CTA's own draw
            rms_norm(x + (nt - 1) * H, side, xn, p.eps, red);
            const auto [r0, r1] = stage_rows(4, cta, ctas);
            const float* s = side + H;
            float* y = p.logits + (size_t)(pass - 1) * V + r0;
            if (st) st[sid * NSTAMP + 4] = clock64();
            const auto put = [&](int, int i, float v) { __stcg(y + i, v * s[i]); };
            if (p.head_bytes == 2) gemv_tok<RH, 1, 1, true>(wb, r1 - r0, H, xn, 0, how, put);
            else gemv_tok<RH, 1>(wb, r1 - r0, H, xn, 0, how, put);
            barrier();
            const float* lg = p.logits + (size_t)(pass - 1) * V;
            tok = MODE == 3 ? 0 : pick_token(lg, do_sample, top_k, top_p, temperature, seed,
                                             counter_base + pass, red, tok_s);
            if (cta == 0 && tid == 0) p.tokens[pass - 1] = tok;
        }
    }
    if ((MODE == 0 || MODE == 3) && !producer) cp_wait<0>();
}

// The largest stage slice of one CTA, in bytes (head_bytes: the heads' bytes a weight).
inline int buf_bytes_for(int ctas, int head_bytes = 1) {
    const int row_bytes[5] = {H, HD, 2 * H, I, H * head_bytes};  // A, B, C (gate, up), D, H
    int b = 0;
    for (int cta = 0; cta < ctas; ++cta)
        for (int kind = 0; kind < 5; ++kind) {
            const Rows w = stage_rows(kind, cta, ctas);
            b = (w.r1 - w.r0) * row_bytes[kind] > b ? (w.r1 - w.r0) * row_bytes[kind] : b;
        }
    return (b + 15) / 16 * 16;
}

// tt: token rows of the activation buffers (2 with OPT_TWO_TOKEN; the kernel's layout)
inline size_t smem_bytes(int buf_bytes, int tt = 1) {
    return (size_t)NBUF * (buf_bytes + SIDE * sizeof(float)) +
           sizeof(float) * (tt * (H + I + 4 * HD + 16) + 2 * WARPS + 2 * WARPS + 2 * G * HD) + 64;
}

}  // namespace megaframe

#ifdef MEGAFRAME_INSTANTIATE  // an offline compile check: nvcc -DMEGAFRAME_INSTANTIATE -c
template __global__ void megaframe::cp_megaframe_kernel<0, -1>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<1, -1>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<2, -1>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<3, -1>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<0, megaframe::SPECIALIZED[0]>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<0, megaframe::SPECIALIZED[4]>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<0, megaframe::SPECIALIZED[5]>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<0, megaframe::SPECIALIZED[6]>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<0, megaframe::SPECIALIZED[7]>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<0, megaframe::SPECIALIZED[8]>(megaframe::Params);
template __global__ void megaframe::cp_megaframe_kernel<0, megaframe::SPECIALIZED[9]>(megaframe::Params);
#endif

#ifdef TORCH_EXTENSION_NAME
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <iterator>
#include <utility>

namespace {

template <int MODE, int FIXED = -1>
void launch_mode(megaframe::Params p, int ctas, size_t smem, cudaStream_t stream) {
    auto k = megaframe::cp_megaframe_kernel<MODE, FIXED>;
    static size_t set = 0;  // once per size, outside any capture's first replay
    if (set != smem) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        set = smem;
    }
    if (p.opts & megaframe::OPT_COOPERATIVE) {
        void* args[] = {&p};
        C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(k), dim3(ctas),
                                                   dim3(megaframe::BLOCK), args, smem, stream));
    } else {
        k<<<ctas, megaframe::BLOCK, smem, stream>>>(p);
    }
}

// The full mode compiled for SPECIALIZED[K] where opts is that entry; false where none is.
using kSpecialized = std::make_integer_sequence<int, (int)std::size(megaframe::SPECIALIZED)>;
template <int... K>
bool launch_specialized(int opts, megaframe::Params p, int ctas, size_t smem,
                        cudaStream_t stream, std::integer_sequence<int, K...>) {
    return ((opts == megaframe::SPECIALIZED[K] &&
             (launch_mode<0, megaframe::SPECIALIZED[K]>(p, ctas, smem, stream), true)) || ...);
}

// ws: the 29 tensors of Params in order (ttsbuild/runtime/cp_megaframe.py); FP8 weights as
// uint8 views; stamps: int64 [2, STAGES, NSTAMP] or empty; opts: OPT_* bits; sampling: a
// SamplingBatch's do_sample (bool), top_k (int64), temperature and top_p (float32) and the
// rows' seeds and frame indices (int64), element `row` of each.
// Zeroes the barrier counter and o on the current stream, then launches (capturable).
void run(std::vector<torch::Tensor> ws, int64_t mode, int64_t ctas, torch::Tensor stamps,
         torch::Tensor do_sample, torch::Tensor top_k, torch::Tensor temperature,
         torch::Tensor top_p, torch::Tensor seed, torch::Tensor frame, int64_t row, double eps,
         int64_t flag_barrier, int64_t opts, int64_t pace_ticks) {
    TORCH_CHECK(ws.size() == 29, "29 tensors expected, got ", ws.size());
    for (auto& t : ws) TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "CUDA contiguous tensors only");
    megaframe::Params p;
    int i = 0;
    auto u8 = [&]() { return ws[i++].data_ptr<uint8_t>(); };
    auto f = [&]() { return ws[i++].data_ptr<float>(); };
    p.wqkv = u8(); p.sqkv = f(); p.wo = u8(); p.so = f(); p.wgu = u8(); p.sgu = f();
    p.wd = u8(); p.sd = f();
    // the heads: FP8 (a uint8 view) or the engine's bf16 heads as they are (scales of 1)
    TORCH_CHECK(ws[i].scalar_type() == at::kByte || ws[i].scalar_type() == at::kBFloat16,
                "whead: FP8 weights as a uint8 view, or bf16");
    p.head_bytes = ws[i].scalar_type() == at::kBFloat16 ? 2 : 1;
    TORCH_CHECK(ws[i].numel() * ws[i].element_size() ==
                    (int64_t)(megaframe::G - 1) * megaframe::V * megaframe::H * p.head_bytes,
                "whead: [G - 1, V, H] weights");
    p.whead = static_cast<const uint8_t*>(ws[i++].data_ptr()); p.shead = f();
    p.in_norm = f(); p.post_norm = f(); p.q_norm = f(); p.k_norm = f(); p.final_norm = f();
    p.tables = f(); p.x_in = f(); p.rope_cos = f(); p.rope_sin = f();
    p.qkv = f(); p.o = f(); p.act = f(); p.d = f(); p.logits = f();
    p.kcache = f(); p.vcache = f();
    p.tokens = ws[i++].data_ptr<int>();
    p.counter = reinterpret_cast<unsigned*>(ws[i++].data_ptr<int>());
    p.wdt = u8();
    p.stamps = stamps.numel() ? reinterpret_cast<long long*>(stamps.data_ptr<int64_t>()) : nullptr;
    TORCH_CHECK(!stamps.numel() || stamps.numel() == 2 * megaframe::STAGES * megaframe::NSTAMP,
                "stamps: [2, STAGES, NSTAMP]");
    TORCH_CHECK(opts >= 0 && opts < 32768, "opts: OPT_* bits (0-32767)");
    TORCH_CHECK(!(opts & megaframe::OPT_EARLY_FREE) || (opts & megaframe::OPT_PRODUCER),
                "OPT_EARLY_FREE needs OPT_PRODUCER");
    TORCH_CHECK(!(opts & megaframe::OPT_SPLIT_DOWN) ||
                (megaframe::H == 4 * megaframe::THREADS &&
                 ws[28].numel() == (int64_t)megaframe::L * megaframe::I * megaframe::H),
                "OPT_SPLIT_DOWN: W_d transposed ([L, I, H] bytes) and 4 outputs a thread");
    const int tt = (opts & megaframe::OPT_TWO_TOKEN) ? 2 : 1;
    TORCH_CHECK(ws[19].numel() >= tt * megaframe::QKV && ws[20].numel() >= tt * megaframe::H &&
                ws[21].numel() >= tt * megaframe::I && ws[22].numel() >= tt * megaframe::H,
                "qkv, o, act, d: a row per token of a pass (2 with OPT_TWO_TOKEN)");
    const bool tagged = opts & megaframe::OPT_TAGGED;
    TORCH_CHECK(!tagged || !(opts & megaframe::OPT_SPLIT_DOWN),
                "OPT_TAGGED and OPT_SPLIT_DOWN do not go together");
    TORCH_CHECK(!tagged || (ws[20].numel() >= 6 * megaframe::H &&
                            ws[21].numel() >= 2 * tt * megaframe::I &&
                            ws[22].numel() >= 2 * tt * megaframe::H),
                "OPT_TAGGED: o of 6 rows (three buffers of two), act and d of 2 floats a value");
    const bool tagged_qkv = opts & megaframe::OPT_TAGGED_QKV;
    TORCH_CHECK(!tagged_qkv || tagged, "OPT_TAGGED_QKV needs OPT_TAGGED");
    TORCH_CHECK(!tagged_qkv || ws[19].numel() >= 2 * tt * megaframe::QKV,
                "OPT_TAGGED_QKV: qkv of 2 floats a value");
    TORCH_CHECK(!(opts & megaframe::OPT_PRODUCER) || (opts & megaframe::OPT_TMA),
                "OPT_PRODUCER needs OPT_TMA");
    p.opts = (int)opts;
    p.eps = (float)eps;
    auto sampling = [&](const torch::Tensor& t, at::ScalarType type, const char* name) {
        TORCH_CHECK(t.is_cuda() && t.scalar_type() == type && t.dim() == 1 && row >= 0 &&
                    row < t.numel(), name, ": a 1-d CUDA tensor of ", c10::toString(type),
                    " with element ", row);
    };
    sampling(do_sample, at::kBool, "do_sample");
    sampling(top_k, at::kLong, "top_k");
    sampling(temperature, at::kFloat, "temperature");
    sampling(top_p, at::kFloat, "top_p");
    sampling(seed, at::kLong, "seed");
    sampling(frame, at::kLong, "frame");
    p.do_sample = do_sample.data_ptr<bool>();
    p.top_k = reinterpret_cast<const long long*>(top_k.data_ptr<int64_t>());
    p.temperature = temperature.data_ptr<float>();
    p.top_p = top_p.data_ptr<float>();
    p.seed = reinterpret_cast<const long long*>(seed.data_ptr<int64_t>());
    p.frame = reinterpret_cast<const long long*>(frame.data_ptr<int64_t>());
    p.row = (int)row;
    int dev = ws[0].get_device(), sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    TORCH_CHECK(ctas >= 2 * megaframe::NH && ctas <= sms, "ctas must be in [32, SMs = ", sms, "]");
    p.buf_bytes = megaframe::buf_bytes_for((int)ctas, p.head_bytes);
    size_t smem = megaframe::smem_bytes(p.buf_bytes, tt);
    TORCH_CHECK(smem <= 227 * 1024, "shared memory ", smem, " > 227 KiB: use more CTAs");
    for (int c = 0; (opts & megaframe::OPT_KV_AHEAD) && c < ctas; ++c)
        TORCH_CHECK(megaframe::kv_offset(c, (int)ctas) + megaframe::KV_AHEAD_BYTES <= p.buf_bytes,
                    "OPT_KV_AHEAD: stage B's buffer cannot hold its K/V rows at ", ctas, " CTAs");
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    p.flag_barrier = (int)flag_barrier;
    TORCH_CHECK(flag_barrier >= 0 && flag_barrier <= 3, "flag_barrier: 0-3");
    TORCH_CHECK(pace_ticks >= 0 && pace_ticks < (1 << 20), "pace_ticks: 0 to 2^20");
    p.pace_ticks = (int)pace_ticks;
    TORCH_CHECK(ws[27].numel() >= ctas, "the barrier words: one per CTA");
    TORCH_CHECK(ctas <= megaframe::THREADS, "at most one CTA per thread of a CTA (flags)");
    TORCH_CHECK(ws[27].numel() >= 32 * megaframe::STRIPES, "the barrier words: 32 x STRIPES");
    cudaMemsetAsync(p.counter, 0, sizeof(int) * ws[27].numel(), stream);
    // OPT_TAGGED: the three o buffers, and every tagged word of act, d (and qkv) (no tag left
    // from the last frame, whose stages had the same ids)
    cudaMemsetAsync(p.o, 0, sizeof(float) * (tagged ? 6 : tt) * megaframe::H, stream);
    cudaMemsetAsync(p.d, 0, sizeof(float) * (tagged ? 2 : 1) * tt * megaframe::H, stream);
    if (tagged) cudaMemsetAsync(p.act, 0, sizeof(float) * 2 * tt * megaframe::I, stream);
    if (tagged_qkv) cudaMemsetAsync(p.qkv, 0, sizeof(float) * 2 * tt * megaframe::QKV, stream);
    // the full frame compiled for its options where SPECIALIZED has them
    const int fixed = (int)opts & ~(megaframe::OPT_COOPERATIVE | megaframe::OPT_GENERIC);
    if (mode == 0 && !(opts & megaframe::OPT_GENERIC) && flag_barrier == 0 &&
        launch_specialized(fixed, p, (int)ctas, smem, stream, kSpecialized{})) {
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
    }
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
