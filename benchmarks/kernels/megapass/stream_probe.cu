// A probe (benchmarks only): how fast one CTA per SM streams weights from HBM into shared
// memory, the way cp_megaframe.cu fetches a stage's slice. Every CTA copies `iters` chunks of
// `chunk` bytes (chunk i of every CTA side by side, as a stage's slices are), keeps
// `depth` copies in flight, reads each chunk once from shared memory, and with `sync` meets
// the other CTAs at a grid barrier after each chunk (the megaframe's stage structure, without
// its math). Copies: TMA bulk copies (`pieces` requests a chunk, completion on an mbarrier) or
// 16-byte cp.async by every thread. Question: is ~7 GB/s an SM (the megaframe's stages racing
// without barriers, 2026-12-05) the hardware's limit for this pattern, or the megaframe's?

#include <cstdint>

namespace probe {

constexpr int THREADS = 256, MAXBUF = 4;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

template <bool TMA>
__global__ void __launch_bounds__(THREADS, 1)
stream_kernel(const uint8_t* src, int chunk, int depth, int iters, int pieces, int sync,
              unsigned* counter, unsigned* sink) {
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ uint64_t mbar[MAXBUF];
    const int tid = threadIdx.x, cta = blockIdx.x, ctas = gridDim.x, nbuf = depth + 1;
    if (tid == 0) {
        for (int i = 0; i < nbuf; ++i)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&mbar[i])));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int i) {
        if (i >= iters) {
            asm volatile("cp.async.commit_group;\n" ::);
            return;
        }
        uint8_t* dst = smem + (size_t)(i % nbuf) * chunk;
        const uint8_t* s = src + ((size_t)i * ctas + cta) * chunk;
        if (TMA) {
            if (tid == 0) {
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                             ::"r"(smem_u32(&mbar[i % nbuf])), "r"(chunk) : "memory");
            }
            __syncwarp();
            const int piece = chunk / pieces;
            if (tid < 32)
                for (int k = tid; k < pieces; k += 32)
                    asm volatile(
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                        "[%0], [%1], %2, [%3];\n"
                        ::"r"(smem_u32(dst + (size_t)k * piece)), "l"(s + (size_t)k * piece),
                        "r"(piece), "r"(smem_u32(&mbar[i % nbuf])) : "memory");
        } else {
            for (int k = tid; k < chunk / 16; k += THREADS)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                             ::"r"(smem_u32(dst + k * 16)), "l"(s + k * 16));
            asm volatile("cp.async.commit_group;\n" ::);
        }
    };
    for (int i = 0; i < depth; ++i) issue(i);
    unsigned acc = 0, barriers = 0;
    for (int i = 0; i < iters; ++i) {
        if (TMA) {
            unsigned done = 0;
            while (!done)
                asm volatile(
                    "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                    " selp.u32 %0, 1, 0, p;\n}\n"
                    : "=r"(done) : "r"(smem_u32(&mbar[i % nbuf])), "r"((unsigned)(i / nbuf) & 1)
                    : "memory");
        } else {
            if (depth == 1) asm volatile("cp.async.wait_group 0;\n" ::);
            else if (depth == 2) asm volatile("cp.async.wait_group 1;\n" ::);
            else asm volatile("cp.async.wait_group 2;\n" ::);
        }
        __syncthreads();
        const uint4* b = reinterpret_cast<const uint4*>(smem + (size_t)(i % nbuf) * chunk);
        for (int k = tid; k < chunk / 16; k += THREADS) {
            uint4 v = b[k];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        if (sync) {
            __syncthreads();
            if (tid == 0) {
                ++barriers;
                asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counter) : "memory");
                unsigned v;
                do {
                    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
                } while (v < barriers * ctas);
            }
        }
        __syncthreads();  // buffer i % nbuf read by all: chunk i + depth may refill buffer (i - 1)
        issue(i + depth);
    }
    if (!TMA) asm volatile("cp.async.wait_group 0;\n" ::);
    if (acc == 0x9E3779B9u) sink[cta] = acc;  // keeps the reads
}

}  // namespace probe

#ifdef PROBE_INSTANTIATE  // an offline compile check: nvcc -DPROBE_INSTANTIATE -c
template __global__ void probe::stream_kernel<true>(const uint8_t*, int, int, int, int, int,
                                                    unsigned*, unsigned*);
template __global__ void probe::stream_kernel<false>(const uint8_t*, int, int, int, int, int,
                                                     unsigned*, unsigned*);
#endif

#ifdef TORCH_EXTENSION_NAME
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

// src: uint8 CUDA tensor of at least ctas * iters * chunk bytes; counter: int32 [1] (zeroed
// here); sink: int32 [ctas]. Launches on the current stream.
void stream(torch::Tensor src, int64_t ctas, int64_t chunk, int64_t depth, int64_t iters,
            int64_t pieces, int64_t sync, int64_t tma, torch::Tensor counter, torch::Tensor sink) {
    TORCH_CHECK(src.is_cuda() && src.numel() >= ctas * iters * chunk, "src too small");
    TORCH_CHECK(depth >= 1 && depth <= 3, "depth 1-3");
    TORCH_CHECK(chunk % (16 * pieces) == 0, "chunk must split into pieces of 16-byte multiples");
    const size_t smem = (size_t)(depth + 1) * chunk;
    TORCH_CHECK(smem <= 227 * 1024, "(depth + 1) * chunk > 227 KiB");
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    cudaMemsetAsync(counter.data_ptr(), 0, 4, stream);
    auto k = tma ? probe::stream_kernel<true> : probe::stream_kernel<false>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    k<<<(int)ctas, probe::THREADS, smem, stream>>>(
        src.data_ptr<uint8_t>(), (int)chunk, (int)depth, (int)iters, (int)pieces, (int)sync,
        reinterpret_cast<unsigned*>(counter.data_ptr<int>()),
        reinterpret_cast<unsigned*>(sink.data_ptr<int>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("stream", &stream, "HBM -> shared memory stream probe"); }
#endif
