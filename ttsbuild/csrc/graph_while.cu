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
// Programmatic edges (kernels captured with programmatic dependent launch, as the Triton
// kernels are on Hopper) inside a conditional body: CUDA's documentation lists the node types
// a body may hold, not the edge types. ttsbuild_while_keeps_programmatic_edges() finds out on
// the device (a WHILE node around a child graph with one programmatic edge, instantiated and
// run once), and capture_while(..., full_edges=1) clones the body with every programmatic
// edge made a full one (the kernels' dependency waits then return at once), so a runtime that
// refuses them still runs the loop.
//
// Built only with CUDA (setup.py adds this file to the step driver where nvcc is there); the
// host function takes plain integers (a stream, a cudaGraph_t, device pointers), so the
// binding in step_driver.cpp needs no CUDA header.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

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

__global__ void probe_add(int* x) { atomicAdd(x, 1); }

__global__ void probe_stop(cudaGraphConditionalHandle handle) {
  cudaGraphSetConditional(handle, 0u);
}

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

cudaError_t graph_edges(cudaGraph_t graph, cudaGraphNode_t* from, cudaGraphNode_t* to,
                        cudaGraphEdgeData* data, size_t* count) {
#if CUDART_VERSION >= 13000
  return cudaGraphGetEdges(graph, from, to, data, count);
#else
  return cudaGraphGetEdges_v2(graph, from, to, data, count);
#endif
}

// One edge removed (add = false) or added; data nullptr: a full dependency.
cudaError_t edit_edge(cudaGraph_t graph, const cudaGraphNode_t* from, const cudaGraphNode_t* to,
                      const cudaGraphEdgeData* data, bool add) {
#if CUDART_VERSION >= 13000
  return add ? cudaGraphAddDependencies(graph, from, to, data, 1)
             : cudaGraphRemoveDependencies(graph, from, to, data, 1);
#else
  return add ? cudaGraphAddDependencies_v2(graph, from, to, data, 1)
             : cudaGraphRemoveDependencies_v2(graph, from, to, data, 1);
#endif
}

// A WHILE node on `handle` in `graph` after `deps`; *body: the graph it runs.
cudaError_t add_while_node(cudaGraph_t graph, const cudaGraphNode_t* deps, size_t count,
                           cudaGraphConditionalHandle handle, cudaGraphNode_t* node,
                           cudaGraph_t* body) {
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeWhile;
  params.conditional.size = 1;
#if CUDART_VERSION >= 13000
  cudaError_t err = cudaGraphAddNode(node, graph, deps, nullptr, count, &params);
#else
  cudaError_t err = cudaGraphAddNode(node, graph, deps, count, &params);
#endif
  if (err == cudaSuccess) *body = params.conditional.phGraph_out[0];
  return err;
}

// A clone of `body` whose programmatic edges (any edge with a non-zero port or type) are full
// dependencies; *replaced counts them. The caller destroys the clone.
const char* clone_with_full_edges(cudaGraph_t body, cudaGraph_t* clone, size_t* replaced) {
  *replaced = 0;
  cudaError_t err = cudaGraphClone(clone, body);
  if (err != cudaSuccess) return failed("cudaGraphClone (the body)", err);
  size_t count = 0;
  err = graph_edges(*clone, nullptr, nullptr, nullptr, &count);
  if (err != cudaSuccess) return failed("cudaGraphGetEdges (count)", err);
  std::vector<cudaGraphNode_t> from(count), to(count);
  std::vector<cudaGraphEdgeData> data(count);
  if (count > 0) {
    err = graph_edges(*clone, from.data(), to.data(), data.data(), &count);
    if (err != cudaSuccess) return failed("cudaGraphGetEdges", err);
  }
  for (size_t i = 0; i < count; ++i) {
    const cudaGraphEdgeData& e = data[i];
    if (e.from_port == 0 && e.to_port == 0 && e.type == cudaGraphDependencyTypeDefault) continue;
    err = edit_edge(*clone, &from[i], &to[i], &e, false);
    if (err != cudaSuccess) return failed("cudaGraphRemoveDependencies (a programmatic edge)", err);
    err = edit_edge(*clone, &from[i], &to[i], nullptr, true);
    if (err != cudaSuccess) return failed("cudaGraphAddDependencies (its full edge)", err);
    ++*replaced;
  }
  return nullptr;
}

int probe_error(const char** error, const char* message) {
  *error = message;
  return -1;
}

// Owns what the probe creates, whatever step fails.
struct Probe {
  cudaGraph_t body = nullptr, outer = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaStream_t stream = nullptr;
  int* x = nullptr;
  ~Probe() {
    if (exec) cudaGraphExecDestroy(exec);
    if (outer) cudaGraphDestroy(outer);
    if (body) cudaGraphDestroy(body);
    if (stream) cudaStreamDestroy(stream);
    if (x) cudaFree(x);
  }
};

cudaError_t add_kernel(cudaGraphNode_t* node, cudaGraph_t graph, const cudaGraphNode_t* deps,
                       size_t count, void* func, void** args) {
  cudaKernelNodeParams p{};
  p.func = func;
  p.gridDim = dim3(1, 1, 1);
  p.blockDim = dim3(1, 1, 1);
  p.kernelParams = args;
  return cudaGraphAddKernelNode(node, graph, deps, count, &p);
}

}  // namespace

// Whether a WHILE node's body may hold programmatic edges on this device and driver: 1 yes,
// 0 no (the runtime refused the graph, or the device has no programmatic launch), -1 with
// *error set when something else failed (no device, out of memory). Not under a capture.
int ttsbuild_while_keeps_programmatic_edges(const char** error) {
  *error = nullptr;
  Probe p;
  cudaError_t err = cudaMalloc(&p.x, sizeof(int));
  if (err != cudaSuccess) return probe_error(error, failed("cudaMalloc (probe)", err));
  err = cudaMemset(p.x, 0, sizeof(int));
  if (err != cudaSuccess) return probe_error(error, failed("cudaMemset (probe)", err));
  // the body: two kernels joined by a programmatic edge
  err = cudaGraphCreate(&p.body, 0);
  if (err != cudaSuccess) return probe_error(error, failed("cudaGraphCreate (probe)", err));
  void* add_args[] = {&p.x};
  cudaGraphNode_t a = nullptr, b = nullptr;
  err = add_kernel(&a, p.body, nullptr, 0, reinterpret_cast<void*>(&probe_add), add_args);
  if (err != cudaSuccess) return probe_error(error, failed("cudaGraphAddKernelNode (probe)", err));
  err = add_kernel(&b, p.body, nullptr, 0, reinterpret_cast<void*>(&probe_add), add_args);
  if (err != cudaSuccess) return probe_error(error, failed("cudaGraphAddKernelNode (probe)", err));
  cudaGraphEdgeData edge{};
  edge.from_port = cudaGraphKernelNodePortProgrammatic;
  edge.type = cudaGraphDependencyTypeProgrammatic;
  if (edit_edge(p.body, &a, &b, &edge, true) != cudaSuccess) {
    cudaGetLastError();
    return 0;  // no programmatic edges at all here (e.g. before Hopper)
  }
  // the outer graph: WHILE (runs once: its next kernel clears the condition) { child(body) }
  err = cudaGraphCreate(&p.outer, 0);
  if (err != cudaSuccess) return probe_error(error, failed("cudaGraphCreate (probe)", err));
  cudaGraphConditionalHandle handle{};
  err = cudaGraphConditionalHandleCreate(&handle, p.outer, 1, cudaGraphCondAssignDefault);
  if (err != cudaSuccess) {
    return probe_error(error, failed("cudaGraphConditionalHandleCreate (probe)", err));
  }
  cudaGraphNode_t node = nullptr;
  cudaGraph_t inner = nullptr;
  err = add_while_node(p.outer, nullptr, 0, handle, &node, &inner);
  if (err != cudaSuccess) return probe_error(error, failed("cudaGraphAddNode (probe WHILE)", err));
  cudaGraphNode_t child = nullptr, stop = nullptr;
  if (cudaGraphAddChildGraphNode(&child, inner, nullptr, 0, p.body) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  void* stop_args[] = {&handle};
  err = add_kernel(&stop, inner, &child, 1, reinterpret_cast<void*>(&probe_stop), stop_args);
  if (err != cudaSuccess) return probe_error(error, failed("cudaGraphAddKernelNode (probe stop)", err));
  if (cudaGraphInstantiate(&p.exec, p.outer, 0) != cudaSuccess) {
    cudaGetLastError();
    p.exec = nullptr;
    return 0;
  }
  err = cudaStreamCreateWithFlags(&p.stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) return probe_error(error, failed("cudaStreamCreate (probe)", err));
  err = cudaGraphLaunch(p.exec, p.stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(p.stream);
  if (err != cudaSuccess) return probe_error(error, failed("running the probe graph", err));
  int ran = 0;
  err = cudaMemcpy(&ran, p.x, sizeof(int), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return probe_error(error, failed("cudaMemcpy (probe)", err));
  if (ran != 2) {
    return probe_error(error, fail("the probe's WHILE body ran its kernels " +
                                   std::to_string(ran) + " times in all instead of 2"));
  }
  return 1;
}

// Returns nullptr on success, else what failed (the binding raises it as a RuntimeError).
const char* ttsbuild_capture_while(std::uintptr_t stream_ptr, std::uintptr_t body_graph,
                                   std::uintptr_t flag_ptr, std::uintptr_t counter_ptr,
                                   int max_iterations, int full_edges) {
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

  cudaGraphNode_t node = nullptr;
  cudaGraph_t inner = nullptr;
  err = add_while_node(graph, deps, count, handle, &node, &inner);
  if (err != cudaSuccess) return failed("cudaGraphAddNode (WHILE)", err);

  cudaGraphNode_t child = nullptr;
  if (full_edges) {
    cudaGraph_t clone = nullptr;
    size_t replaced = 0;
    const char* why = clone_with_full_edges(body, &clone, &replaced);
    if (why == nullptr) {
      err = cudaGraphAddChildGraphNode(&child, inner, nullptr, 0, clone);  // clones it again
      if (err != cudaSuccess) why = failed("cudaGraphAddChildGraphNode (the body)", err);
    }
    if (clone != nullptr) cudaGraphDestroy(clone);
    if (why != nullptr) return why;
  } else {
    err = cudaGraphAddChildGraphNode(&child, inner, nullptr, 0, body);
    if (err != cudaSuccess) return failed("cudaGraphAddChildGraphNode (the body)", err);
  }

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
