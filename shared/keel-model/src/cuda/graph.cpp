// A C ABI over libtorch's own CUDA graphs (at::cuda::CUDAGraph), which tch does not bind.
// build.rs compiles this file into a shared library against the headers of the torch in
// .venv and links it to libtorch_cuda; cuda/graph.rs embeds it and loads it only when a
// CUDA device is used, so CPU builds and runs never need CUDA. Every entry point catches
// C++ exceptions: 0 is success, 1 a failure whose message keel_graph_last_error returns.

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <exception>
#include <optional>
#include <string>

namespace {

thread_local std::string last_error;

// A graph and, while it captures, the side stream made current for the capture (a capture
// cannot run on the legacy default stream libtorch uses otherwise).
struct Graph {
    at::cuda::CUDAGraph graph;
    std::optional<c10::cuda::CUDAStreamGuard> capturing;
};

template <typename F>
int guarded(F&& f) {
    try {
        f();
        return 0;
    } catch (const std::exception& e) {
        last_error = e.what();
    } catch (...) {
        last_error = "an unknown C++ exception";
    }
    return 1;
}

}  // namespace

extern "C" {

const char* keel_graph_last_error() { return last_error.c_str(); }

void* keel_graph_new() {
    Graph* graph = nullptr;
    guarded([&] { graph = new Graph(); });
    return graph;
}

void keel_graph_free(void* graph) { delete static_cast<Graph*>(graph); }

// A new memory pool id that several graphs can share (they never replay at once).
int keel_graph_pool(unsigned long long* first, unsigned long long* second) {
    return guarded([&] {
        auto id = at::cuda::graph_pool_handle();
        *first = id.first;
        *second = id.second;
    });
}

// Waits for the device, makes a side stream of `device` current and starts capturing on it
// into the pool (first, second).
int keel_graph_begin(void* graph, int device, unsigned long long first, unsigned long long second) {
    return guarded([&] {
        auto* g = static_cast<Graph*>(graph);
        c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device));
        c10::cuda::device_synchronize();
        g->capturing.emplace(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device)));
        try {
            g->graph.capture_begin({first, second});
        } catch (...) {
            g->capturing.reset();
            throw;
        }
    });
}

// Ends the capture and restores the stream that was current before it, even when ending
// fails (a capture that was invalidated).
int keel_graph_end(void* graph) {
    return guarded([&] {
        auto* g = static_cast<Graph*>(graph);
        try {
            g->graph.capture_end();
        } catch (...) {
            g->capturing.reset();
            throw;
        }
        g->capturing.reset();
        c10::cuda::device_synchronize();
    });
}

// Replays the graph on the current stream.
int keel_graph_replay(void* graph) { return guarded([&] { static_cast<Graph*>(graph)->graph.replay(); }); }

// libtorch's current stream on `device` (the capture stream while capturing), or null.
void* keel_graph_current_stream(int device) {
    void* stream = nullptr;
    guarded([&] { stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(); });
    return stream;
}

// Gives the memory libtorch's caching allocator holds but no tensor uses back to the driver,
// for another process on the same GPU (a colocated trainer or generator taking its turn).
int keel_cuda_empty_cache() {
    return guarded([&] { c10::cuda::CUDACachingAllocator::emptyCache(); });
}

}  // extern "C"
