// The step driver: the thin C++ layer under the Python runtime.
//
// One call launches one engine step: stage its inputs (host -> device), run the step (replay a
// captured CUDA graph, or call a Python function on the eager backend), then copy its outputs
// device -> pinned host memory on a copy stream, behind an event. Python gets a ticket back
// at once and later waits on it with the GIL released, so the next step can be launched (and
// the asyncio side can run) while the device works. Scheduling policy stays in Python.
//
// Lanes: each step runs on a lane. Lane 0 is the caller's current stream (every step in order
// with everything else the caller does). add_lane() makes a lane with its own stream (high or
// low priority) and its own copy stream; a "joined" lane forks from the caller's current stream
// before each step and joins back after it, so from the outside it looks like the current
// stream but its kernels get the lane's priority. Steps of different unjoined lanes run
// concurrently: a step waits for another lane's step only when the caller names that step's
// ticket in `after` (where data flows from one to the other), and device_wait() makes the
// caller's current stream wait for named steps.
//
// Ordering on CUDA, per lane: inputs are copied on the lane's stream, so they are ordered with
// its steps; the lane's copy stream waits for the step's event before reading its outputs; and
// the lane's next step waits (on the device, not the host) until its last copy-out finished,
// because it rewrites the same static output buffers. One copy stream per lane: a lane's
// outputs never queue behind another lane's step.
//
// Built CPU-only where there is no CUDA (TTSBUILD_WITH_CUDA undefined): then every step is a
// Python function, every ticket is complete when launch() returns and lanes only label steps.

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <unordered_map>
#include <vector>

#ifdef TTSBUILD_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;

namespace {

void check_pairs(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                 const char* what) {
  TORCH_CHECK(src.size() == dst.size(), what, ": ", src.size(), " sources but ", dst.size(),
              " destinations");
  for (size_t i = 0; i < src.size(); ++i) {
    TORCH_CHECK(src[i].sizes() == dst[i].sizes(), what, " copy ", i, ": shape ", src[i].sizes(),
                " -> ", dst[i].sizes());
  }
}

void copy_all(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
              bool non_blocking) {
  for (size_t i = 0; i < src.size(); ++i) {
    // copy_ on a const Tensor handle is fine: the handle is const, the storage is not.
    const_cast<at::Tensor&>(dst[i]).copy_(src[i], non_blocking);
  }
}

}  // namespace

class StepDriver {
 public:
  explicit StepDriver(bool cuda) : cuda_(cuda) {
#ifndef TTSBUILD_WITH_CUDA
    TORCH_CHECK(!cuda_, "ttsbuild's step driver was built without CUDA support");
#endif
    lanes_.emplace_back();  // lane 0: the caller's current stream
#ifdef TTSBUILD_WITH_CUDA
    if (cuda_) lanes_[0].copy_stream = copy_stream();
#endif
  }

  bool cuda() const { return cuda_; }

  // A lane with its own stream; returns its id. high_priority: its kernels are scheduled
  // before those of normal-priority streams when both wait for the GPU. join: fork from and
  // join back to the caller's current stream around each step (see the file comment).
  // priority < 0: that CUDA stream priority instead (lower is more urgent; torch clamps it to
  // the levels it keeps, and high_priority is the most urgent of them), so lanes can be
  // ranked: e.g. a new request's first frame above running streams' frames above the codec.
  int64_t add_lane(bool high_priority, bool join, int64_t priority) {
    TORCH_CHECK(priority <= 0, "a lane priority is <= 0 (lower: more urgent), got ", priority);
    Lane lane;
    lane.join = join;
#ifdef TTSBUILD_WITH_CUDA
    if (cuda_) {
      lane.stream = std::make_unique<c10::cuda::CUDAStream>(
          priority < 0 ? c10::cuda::getStreamFromPool(static_cast<int>(priority))
                       : c10::cuda::getStreamFromPool(high_priority));
      lane.copy_stream = copy_stream();
    }
#endif
    lanes_.push_back(std::move(lane));
    return static_cast<int64_t>(lanes_.size()) - 1;
  }

  // A lane on a stream made elsewhere (e.g. a green context's stream, so the lane's steps
  // run on that context's SMs), given as its cudaStream_t; it gets its own copy stream. join:
  // as for add_lane. The stream must outlive the driver.
  int64_t add_external_lane(int64_t stream_ptr, bool join) {
    Lane lane;
    lane.join = join;
#ifdef TTSBUILD_WITH_CUDA
    TORCH_CHECK(cuda_, "an external stream needs a CUDA step driver");
    TORCH_CHECK(stream_ptr != 0, "an external lane needs a stream (got a null cudaStream_t)");
    lane.stream = std::make_unique<c10::cuda::CUDAStream>(c10::cuda::getStreamFromExternal(
        reinterpret_cast<cudaStream_t>(stream_ptr), c10::cuda::current_device()));
    lane.copy_stream = copy_stream();
#else
    TORCH_CHECK(false, "the step driver was built without CUDA: it has no external streams");
#endif
    lanes_.push_back(std::move(lane));
    return static_cast<int64_t>(lanes_.size()) - 1;
  }

  int64_t lanes() const { return static_cast<int64_t>(lanes_.size()); }

  // The CUDA stream a lane's steps run on (0: the caller's current stream, or no CUDA).
  int64_t lane_stream(int64_t lane) const {
    check_lane(lane);
#ifdef TTSBUILD_WITH_CUDA
    if (lanes_[lane].stream) return reinterpret_cast<int64_t>(lanes_[lane].stream->stream());
#endif
    return 0;
  }

  // step: a torch.cuda.CUDAGraph (CUDA) or a Python callable (either). after: tickets of
  // steps (any lane) this one must follow on the device; finished ones are skipped.
  int64_t launch(py::object step, const std::vector<at::Tensor>& h2d_src,
                 const std::vector<at::Tensor>& h2d_dst, const std::vector<at::Tensor>& d2h_src,
                 const std::vector<at::Tensor>& d2h_dst, int64_t lane_id,
                 const std::vector<int64_t>& after) {
    check_pairs(h2d_src, h2d_dst, "input");
    check_pairs(d2h_src, d2h_dst, "output");
    check_lane(lane_id);
#ifdef TTSBUILD_WITH_CUDA
    if (cuda_) {
      check_host(h2d_src, "input source");
      check_host(d2h_dst, "output destination");
    }
#endif
    for (int64_t t : after) check_ticket(t);
    const int64_t ticket = next_ticket_++;
#ifdef TTSBUILD_WITH_CUDA
    if (cuda_) {
      Lane& lane = lanes_[lane_id];
      at::cuda::CUDAGraph* graph = nullptr;
      try {
        graph = &py::cast<at::cuda::CUDAGraph&>(step);
      } catch (const py::cast_error&) {
        graph = nullptr;  // a Python function: run it with the GIL held
      }
      auto caller = c10::cuda::getCurrentCUDAStream();
      auto compute = lane.stream ? *lane.stream : caller;
      auto done = std::make_shared<at::cuda::CUDAEvent>();
      auto step_done = std::make_shared<at::cuda::CUDAEvent>();
      std::shared_ptr<at::cuda::CUDAEvent> started, ended;
      if (timing_) {
        started = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
        ended = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
      }
      {
        // The GIL stays held through a launch unless asked otherwise: a launch queues work
        // and returns in microseconds, while taking the GIL back after releasing it can take
        // the interpreter's whole switch interval (5 ms) when another thread (the server's
        // event loop) holds it meanwhile.
        std::optional<py::gil_scoped_release> no_gil;
        if (launch_releases_gil_) no_gil.emplace();
        c10::cuda::CUDAStreamGuard on_lane(compute);
        if (lane.stream && lane.join) {
          at::cuda::CUDAEvent fork;
          fork.record(caller);
          fork.block(compute);
        }
        for (int64_t t : after) {
          auto it = step_done_.find(t);
          if (it != step_done_.end()) it->second->block(compute);
        }
        if (lane.last_copy_out) lane.last_copy_out->block(compute);
        copy_all(h2d_src, h2d_dst, /*non_blocking=*/true);
        if (started) started->record(compute);
        if (graph != nullptr) graph->replay();
      }
      if (graph == nullptr) {
        c10::cuda::CUDAStreamGuard on_lane(compute);  // the step's kernels go to the lane
        step();
      }
      {
        std::optional<py::gil_scoped_release> no_gil;
        if (launch_releases_gil_) no_gil.emplace();
        if (ended) ended->record(compute);
        step_done->record(compute);
        if (lane.stream && lane.join) step_done->block(caller);
        step_done->block(*lane.copy_stream);
        {
          c10::cuda::CUDAStreamGuard guard(*lane.copy_stream);
          copy_all(d2h_src, d2h_dst, /*non_blocking=*/true);
        }
        done->record(*lane.copy_stream);
      }
      lane.last_copy_out = done;
      pending_[ticket] = done;
      step_done_[ticket] = step_done;
      if (timing_) timed_[ticket] = {started, ended};
      return ticket;
    }
#endif
    copy_all(h2d_src, h2d_dst, /*non_blocking=*/false);
    step();
    copy_all(d2h_src, d2h_dst, /*non_blocking=*/false);
    return ticket;
  }

  // The caller's current stream waits (on the device) for these steps; finished ones and
  // unknown-to-CUDA (CPU) ones are skipped.
  void device_wait(const std::vector<int64_t>& tickets) {
    for (int64_t t : tickets) check_ticket(t);
#ifdef TTSBUILD_WITH_CUDA
    if (!cuda_) return;
    auto caller = c10::cuda::getCurrentCUDAStream();
    for (int64_t t : tickets) {
      auto it = step_done_.find(t);
      if (it != step_done_.end()) it->second->block(caller);
    }
#endif
  }

  // True once the ticket's outputs are in host memory (never blocks).
  bool ready(int64_t ticket) {
#ifdef TTSBUILD_WITH_CUDA
    auto it = pending_.find(ticket);
    if (it != pending_.end()) return it->second->query();
#endif
    check_ticket(ticket);
    return true;
  }

  // Blocks until the ticket's outputs are in host memory, without holding the GIL.
  void wait(int64_t ticket) {
    check_ticket(ticket);
#ifdef TTSBUILD_WITH_CUDA
    step_done_.erase(ticket);  // complete once its copy-out is: nothing need wait for it
    auto it = pending_.find(ticket);
    if (it == pending_.end()) return;
    auto event = it->second;
    pending_.erase(it);
    if (event->query()) return;  // done: no GIL round trip (see launch)
    py::gil_scoped_release no_gil;
    event->synchronize();
#endif
  }

  // Whether launch() releases the GIL while it queues the step (default: no, see launch).
  void set_launch_releases_gil(bool on) { launch_releases_gil_ = on; }
  bool launch_releases_gil() const { return launch_releases_gil_; }

  int64_t in_flight() const {
#ifdef TTSBUILD_WITH_CUDA
    return static_cast<int64_t>(pending_.size());
#else
    return 0;
#endif
  }

  // Step timing for timelines (CUDA only): from enable_timing(true) on, each step records
  // timing events around its run (after its waits and input copies); step_times(ticket)
  // returns (start, end) in ms since the start of the first step asked about, and
  // forgets them.
  void enable_timing(bool on) { timing_ = on; }

  std::pair<double, double> step_times(int64_t ticket) {
    check_ticket(ticket);
#ifdef TTSBUILD_WITH_CUDA
    auto it = timed_.find(ticket);
    TORCH_CHECK(it != timed_.end(), "ticket ", ticket, " was not timed");
    auto [started, ended] = it->second;
    timed_.erase(it);
    ended->synchronize();
    if (!time_zero_) time_zero_ = started;
    return {time_zero_->elapsed_time(*started), time_zero_->elapsed_time(*ended)};
#else
    TORCH_CHECK(false, "step timing needs CUDA");
    return {0.0, 0.0};
#endif
  }

 private:
  struct Lane {
    bool join = false;
#ifdef TTSBUILD_WITH_CUDA
    std::unique_ptr<c10::cuda::CUDAStream> stream;  // null: the caller's current stream
    std::unique_ptr<c10::cuda::CUDAStream> copy_stream;
    std::shared_ptr<at::cuda::CUDAEvent> last_copy_out;
#endif
  };

  void check_lane(int64_t lane) const {
    TORCH_CHECK(lane >= 0 && lane < static_cast<int64_t>(lanes_.size()), "unknown lane ", lane);
  }

#ifdef TTSBUILD_WITH_CUDA
  // Host buffers of an asynchronous copy must be pinned and contiguous: otherwise the copy
  // goes through pageable memory, and the CUDA runtime makes the host wait for the stream.
  static void check_host(const std::vector<at::Tensor>& host, const char* what) {
    for (size_t i = 0; i < host.size(); ++i) {
      const auto& t = host[i];
      if (!t.is_cpu()) continue;
      TORCH_CHECK(t.is_contiguous(), what, " ", i, " is a strided host tensor (sizes ",
                  t.sizes(), ", strides ", t.strides(),
                  "): its copy would wait for the step on the host; pass a contiguous one");
      TORCH_CHECK(t.is_pinned(), what, " ", i,
                  " is not in pinned host memory: its copy would wait for the step on the host");
    }
  }
#endif

  void check_ticket(int64_t ticket) const {
    TORCH_CHECK(ticket >= 0 && ticket < next_ticket_, "unknown ticket ", ticket);
  }

#ifdef TTSBUILD_WITH_CUDA
  static std::unique_ptr<c10::cuda::CUDAStream> copy_stream() {
    return std::make_unique<c10::cuda::CUDAStream>(
        c10::cuda::getStreamFromPool(/*isHighPriority=*/true));
  }
#endif

  bool cuda_;
  bool timing_ = false;
  bool launch_releases_gil_ = false;
  int64_t next_ticket_ = 0;
  std::vector<Lane> lanes_;
#ifdef TTSBUILD_WITH_CUDA
  std::unordered_map<int64_t, std::shared_ptr<at::cuda::CUDAEvent>> pending_;    // copy-out done
  std::unordered_map<int64_t, std::shared_ptr<at::cuda::CUDAEvent>> step_done_;  // step done
  std::unordered_map<int64_t, std::pair<std::shared_ptr<at::cuda::CUDAEvent>,
                                        std::shared_ptr<at::cuda::CUDAEvent>>>
      timed_;
  std::shared_ptr<at::cuda::CUDAEvent> time_zero_;
#endif
};

bool built_with_cuda() {
#ifdef TTSBUILD_WITH_CUDA
  return true;
#else
  return false;
#endif
}

namespace {

// Errors leave the driver as Python RuntimeErrors raised here, at the binding, with the
// message alone (no C++ backtrace); Python errors from a step (the eager backend's functions)
// pass through as they are. (On the H200 image every refusal once killed the process with a
// segmentation fault: the driver had been linked with a private static libstdc++, see
// setup.py; not the translators, as first suspected.)
[[noreturn]] void raise_runtime_error(const char* message) {
  PyErr_SetString(PyExc_RuntimeError, message);
  throw py::error_already_set();
}

template <typename R, typename C, typename... A, typename M>
auto guarded_impl(M method) {
  return [method](C& self, A... args) -> R {
    try {
      return (self.*method)(std::forward<A>(args)...);
    } catch (const py::error_already_set&) {
      throw;
    } catch (const c10::Error& e) {
      raise_runtime_error(e.what_without_backtrace());
    } catch (const std::exception& e) {
      raise_runtime_error(e.what());
    }
  };
}

template <typename R, typename C, typename... A>
auto guarded(R (C::*method)(A...)) {
  return guarded_impl<R, C, A...>(method);
}

template <typename R, typename C, typename... A>
auto guarded(R (C::*method)(A...) const) {
  return guarded_impl<R, const C, A...>(method);
}

#ifdef TTSBUILD_GRAPH_WHILE
}  // namespace

// graph_while.cu (compiled by nvcc into the same extension where CUDA is there)
const char* ttsbuild_capture_while(std::uintptr_t stream_ptr, std::uintptr_t body_graph,
                                   std::uintptr_t flag_ptr, std::uintptr_t counter_ptr,
                                   int max_iterations, int full_edges);
int ttsbuild_while_keeps_programmatic_edges(const char** error);

namespace {

// A WHILE node at the capturing stream's current position: the body graph (a cudaGraph_t)
// runs while the int32 at flag is non-zero, at most max_iterations times (graph_while.cu);
// full_edges: the body's programmatic edges made full dependencies.
void capture_while(std::uintptr_t stream, std::uintptr_t body_graph, std::uintptr_t flag,
                   std::uintptr_t counter, int max_iterations, bool full_edges) {
  if (const char* error = ttsbuild_capture_while(stream, body_graph, flag, counter,
                                                 max_iterations, full_edges ? 1 : 0)) {
    raise_runtime_error(error);
  }
}

// Whether this device and driver run a WHILE body that holds programmatic edges (a probe graph
// instantiated and run once: graph_while.cu).
bool while_keeps_programmatic_edges() {
  const char* error = nullptr;
  const int kept = ttsbuild_while_keeps_programmatic_edges(&error);
  if (kept < 0) raise_runtime_error(error);
  return kept == 1;
}
#endif

std::unique_ptr<StepDriver> make_step_driver(bool cuda) {
  try {
    return std::make_unique<StepDriver>(cuda);
  } catch (const c10::Error& e) {
    raise_runtime_error(e.what_without_backtrace());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ttsbuild's step driver: launch a step, copy its outputs out behind an event.";
  m.def("built_with_cuda", &built_with_cuda);
#ifdef TTSBUILD_GRAPH_WHILE
  m.def("capture_while", &capture_while, py::arg("stream"), py::arg("body_graph"),
        py::arg("flag"), py::arg("counter"), py::arg("max_iterations"),
        py::arg("full_edges") = false,
        "A WHILE node at the capturing stream's current position (ttsbuild/csrc/graph_while.cu).");
  m.def("while_keeps_programmatic_edges", &while_keeps_programmatic_edges,
        "Whether a WHILE node's body may hold programmatic edges here (probed on the device).");
#endif
  py::class_<StepDriver>(m, "StepDriver")
      .def(py::init(&make_step_driver), py::arg("cuda"))
      .def_property_readonly("cuda", &StepDriver::cuda)
      .def("add_lane", guarded(&StepDriver::add_lane), py::arg("high_priority"), py::arg("join"),
           py::arg("priority") = 0)
      .def("add_external_lane", guarded(&StepDriver::add_external_lane), py::arg("stream"),
           py::arg("join"))
      .def_property_readonly("lanes", guarded(&StepDriver::lanes))
      .def("lane_stream", guarded(&StepDriver::lane_stream), py::arg("lane"))
      .def("launch", guarded(&StepDriver::launch), py::arg("step"), py::arg("h2d_src"),
           py::arg("h2d_dst"), py::arg("d2h_src"), py::arg("d2h_dst"), py::arg("lane") = 0,
           py::arg("after") = std::vector<int64_t>{})
      .def("device_wait", guarded(&StepDriver::device_wait), py::arg("tickets"))
      .def("enable_timing", guarded(&StepDriver::enable_timing), py::arg("on"))
      .def("step_times", guarded(&StepDriver::step_times), py::arg("ticket"))
      .def("ready", guarded(&StepDriver::ready), py::arg("ticket"))
      .def("wait", guarded(&StepDriver::wait), py::arg("ticket"))
      .def_property("launch_releases_gil", &StepDriver::launch_releases_gil,
                    &StepDriver::set_launch_releases_gil)
      .def_property_readonly("in_flight", guarded(&StepDriver::in_flight));
}
