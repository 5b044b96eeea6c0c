// WHILE nodes in a CUDA graph under stream capture: a body graph that the device runs again
// while a flag in device memory holds, up to a fixed number of iterations.
//
// torch 2.11 (the GPU image's) has no conditional nodes in Python, and torch's own (2.13's
// CUDAGraph::begin_capture_to_if_node) captures the body on a second stream, which needs the
// caching allocator routed to the child capture. Here the body is captured first as a graph
// of its own (torch.cuda.CUDAGraph(keep_graph=True): its memory is its own pool, kept while
// the CUDAGraph object lives) and cloned into the WHILE node's body as a child graph node, so
// the allocator never sees a nested capture.
//
// What capture_while() adds at the capturing stream's current position:
//   enter kernel (counter = 0; condition = flag != 0 and max_iterations > 0)
//   -> WHILE node { child graph (the body) -> next kernel (counter += 1;
//                   condition = flag != 0 and counter < max_iterations) }
//   -> an empty kernel
// The enter and the empty kernel are plain launches, so every edge into and out of the
// conditional node is a full dependency (programmatic edges are only allowed between kernel
// nodes; the kernels captured around it may be launched with programmatic dependent launch).
// The body must set the flag itself (e.g. "some row is not done"); max_iterations bounds the
// loop whatever the flag does.
//
// Built only with CUDA (setup.py adds this file to the step driver where nvcc is there); the
// host function takes plain integers (a stream, a cudaGraph_t, device pointers), so the
// binding in step_driver.cpp needs no CUDA header.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#if CUDART_VERSION < 12040
#error "WHILE nodes need CUDA 12.4 or later"
#endif

namespace {

__global__ void while_enter(cudaGraphConditionalHandle handle, const int* flag, int* counter,
                            int max_iterations) {
  *counter = 0;
  cudaGraphSetConditional(handle, (max_iterations > 0 && *flag != 0) ? 1u : 0u);
}

__global__ void while_next(cudaGraphConditionalHandle handle, const int* flag, int* counter,
                           int max_iterations) {
  const int done = *counter + 1;
  *counter = done;
  cudaGraphSetConditional(handle, (done < max_iterations && *flag != 0) ? 1u : 0u);
}

__global__ void after_while() {}

// The last failure's message (the host function returns a pointer to it: a C string keeps the
// binding free of any std::string ABI question between nvcc's and the C++ compiler's objects).
thread_local std::string last_error;

const char* fail(const std::string& message) {
  last_error = message;
  return last_error.c_str();
}

const char* failed(const char* what, cudaError_t err) {
  return fail(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
              ")");
}

// The capture's graph and its current dependencies.
cudaError_t capture_info(cudaStream_t stream, cudaStreamCaptureStatus* status, cudaGraph_t* graph,
                         const cudaGraphNode_t** deps, size_t* count) {
  unsigned long long id = 0;
#if CUDART_VERSION >= 13000
  const cudaGraphEdgeData* edges = nullptr;
  return cudaStreamGetCaptureInfo(stream, status, &id, graph, deps, &edges, count);
#else
  return cudaStreamGetCaptureInfo_v2(stream, status, &id, graph, deps, count);
#endif
}

}  // namespace

// Returns nullptr on success, else what failed (the binding raises it as a RuntimeError).
const char* ttsbuild_capture_while(std::uintptr_t stream_ptr, std::uintptr_t body_graph,
                                   std::uintptr_t flag_ptr, std::uintptr_t counter_ptr,
                                   int max_iterations) {
  auto stream = reinterpret_cast<cudaStream_t>(stream_ptr);
  auto body = reinterpret_cast<cudaGraph_t>(body_graph);
  auto flag = reinterpret_cast<const int*>(flag_ptr);
  auto counter = reinterpret_cast<int*>(counter_ptr);
  if (body == nullptr || flag == nullptr || counter == nullptr) {
    return fail("capture_while: the body graph, flag and counter must not be null");
  }
  if (max_iterations < 0) {
    return fail("capture_while: max_iterations must be >= 0");
  }

  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  size_t count = 0;
  cudaError_t err = capture_info(stream, &status, &graph, &deps, &count);
  if (err != cudaSuccess) return failed("cudaStreamGetCaptureInfo", err);
  if (status != cudaStreamCaptureStatusActive) {
    return fail("capture_while: the stream is not capturing a graph");
  }

  cudaGraphConditionalHandle handle{};
  err = cudaGraphConditionalHandleCreate(&handle, graph, 0, 0);
  if (err != cudaSuccess) return failed("cudaGraphConditionalHandleCreate", err);

  while_enter<<<1, 1, 0, stream>>>(handle, flag, counter, max_iterations);
  err = cudaGetLastError();
  if (err != cudaSuccess) return failed("launching the WHILE node's enter kernel", err);
  err = capture_info(stream, &status, &graph, &deps, &count);
  if (err != cudaSuccess) return failed("cudaStreamGetCaptureInfo", err);

  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeWhile;
  params.conditional.size = 1;
  cudaGraphNode_t node = nullptr;
#if CUDART_VERSION >= 13000
  err = cudaGraphAddNode(&node, graph, deps, nullptr, count, &params);
#else
  err = cudaGraphAddNode(&node, graph, deps, count, &params);
#endif
  if (err != cudaSuccess) return failed("cudaGraphAddNode (WHILE)", err);
  cudaGraph_t inner = params.conditional.phGraph_out[0];

  cudaGraphNode_t child = nullptr;
  err = cudaGraphAddChildGraphNode(&child, inner, nullptr, 0, body);
  if (err != cudaSuccess) return failed("cudaGraphAddChildGraphNode (the body)", err);

  void* args[] = {&handle, &flag, &counter, &max_iterations};
  cudaKernelNodeParams next{};
  next.func = reinterpret_cast<void*>(&while_next);
  next.gridDim = dim3(1, 1, 1);
  next.blockDim = dim3(1, 1, 1);
  next.sharedMemBytes = 0;
  next.kernelParams = args;
  next.extra = nullptr;
  cudaGraphNode_t next_node = nullptr;
  err = cudaGraphAddKernelNode(&next_node, inner, &child, 1, &next);
  if (err != cudaSuccess) return failed("cudaGraphAddKernelNode (the WHILE node's next kernel)", err);

#if CUDART_VERSION >= 13000
  err = cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                            cudaStreamSetCaptureDependencies);
#else
  err = cudaStreamUpdateCaptureDependencies(stream, &node, 1, cudaStreamSetCaptureDependencies);
#endif
  if (err != cudaSuccess) return failed("cudaStreamUpdateCaptureDependencies", err);

  after_while<<<1, 1, 0, stream>>>();
  err = cudaGetLastError();
  if (err != cudaSuccess) return failed("launching the kernel after the WHILE node", err);
  return nullptr;
}
