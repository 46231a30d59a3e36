// cuDNN fused attention (flash-style SDPA forward and backward with softmax stats)
// through the header-only cudnn-frontend, behind the small C interface of cudnn_sdpa.h.
//
// - libcudnn.so.9 is opened at run time (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): the
//   binary builds without cuDNN and only the attention calls need it. The library path
//   can be overridden with LONGCTX_CUDNN_LIB (e.g. a pip wheel's libcudnn.so.9).
// - One cuDNN graph per (device, dtype, b, s, t, hq, hkv, d, mask, band bounds, scale,
//   direction),
//   built once and cached; one cuDNN handle per device. A global mutex serialises graph
//   building and the (short) enqueue of an execution, so ranks on threads may share it.
// - Tensors are BSHD contiguous; cuDNN takes logical dims [b, h, s, d] with strides, so
//   BSHD is just the stride vector (s*h*d, d, h*d, 1): no transposes.
// - lse [b, hq, s] f32 is cuDNN's Stats [b, hq, s, 1] (natural-log LSE of scaled scores).
// - The backward is given the final o and lse: cuDNN recomputes P = exp(scale*qk - lse)
//   and D = rowsum(do * o) from them, which is what a split (ring) backward needs.
// - Workspace: stream-ordered cudaMallocAsync / cudaFreeAsync around each execution.

#include "cudnn_sdpa.h"

#include <cudnn_frontend.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

namespace cudnn_frontend {
// The frontend's dynamic-loading mode resolves every cuDNN symbol from this handle.
void *cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace fe = cudnn_frontend;

namespace {

// uids of the graph tensors (the variant pack maps them to device pointers)
enum Uid : int64_t { Q = 1, K, V, O, STATS, DO, DQ, DK, DV };

struct Failure {
    int code;
    std::string msg;
};

std::mutex g_mu;  // guards everything below
std::string g_load_error;
bool g_load_tried = false;
std::map<int, cudnnHandle_t> g_handles;

using Key =
    std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int64_t, int64_t, uint32_t, int>;
std::map<Key, std::shared_ptr<fe::graph::Graph>> g_graphs;

void write_err(char *err, size_t len, const std::string &msg) {
    if (err == nullptr || len == 0) return;
    std::snprintf(err, len, "%s", msg.c_str());
}

// Opens libcudnn once; throws Failure(UNAVAILABLE) with the dlerror text otherwise.
void load_cudnn_locked() {
    if (fe::cudnn_dlhandle != nullptr) return;
    if (g_load_tried) throw Failure{LONGCTX_SDPA_UNAVAILABLE, g_load_error};
    g_load_tried = true;
    const char *env = std::getenv("LONGCTX_CUDNN_LIB");
    const char *path = (env != nullptr && env[0] != '\0') ? env : "libcudnn.so.9";
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
        const char *e = dlerror();
        g_load_error = std::string("cannot load cuDNN (") + path + "): " + (e ? e : "unknown error") +
                       "; install cuDNN 9 (libcudnn.so.9 on LD_LIBRARY_PATH) or set LONGCTX_CUDNN_LIB";
        throw Failure{LONGCTX_SDPA_UNAVAILABLE, g_load_error};
    }
    fe::cudnn_dlhandle = h;
}

void check_cuda(cudaError_t e, const char *what) {
    if (e != cudaSuccess) throw Failure{LONGCTX_SDPA_FAILED, std::string(what) + ": " + cudaGetErrorString(e)};
}

void check_fe(fe::error_t e, int code, const char *what) {
    if (e.is_bad()) throw Failure{code, std::string("cuDNN ") + what + ": " + e.get_message()};
}

// cuDNN fused attention needs Ampere or newer; returns the handle for `ordinal`.
cudnnHandle_t handle_locked(int ordinal) {
    check_cuda(cudaSetDevice(ordinal), "cudaSetDevice");
    auto it = g_handles.find(ordinal);
    if (it != g_handles.end()) return it->second;
    int major = 0, minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal), "compute capability");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal), "compute capability");
    if (major < 8) {
        throw Failure{LONGCTX_SDPA_UNSUPPORTED, "cuDNN fused attention needs compute capability 8.0 or newer, device " +
                                                    std::to_string(ordinal) + " is " + std::to_string(major) + "." +
                                                    std::to_string(minor)};
    }
    cudnnHandle_t h = nullptr;
    auto st = fe::detail::create_handle(&h);
    if (st != CUDNN_STATUS_SUCCESS) {
        throw Failure{LONGCTX_SDPA_FAILED, std::string("cudnnCreate failed: ") + fe::detail::get_error_string(st)};
    }
    g_handles[ordinal] = h;
    return h;
}

uint32_t float_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

// A BSHD tensor [b, seq, h, d] described with cuDNN's logical dims [b, h, seq, d].
std::shared_ptr<fe::graph::Tensor_attributes> bshd(fe::graph::Graph &g, const char *name, int64_t uid, int64_t b,
                                                   int64_t seq, int64_t h, int64_t d) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({b, h, seq, d})
                        .set_stride({seq * h * d, d, h * d, 1}));
}

void set_bshd(const std::shared_ptr<fe::graph::Tensor_attributes> &t, int64_t uid, int64_t b, int64_t seq, int64_t h,
              int64_t d) {
    t->set_output(true).set_uid(uid).set_dim({b, h, seq, d}).set_stride({seq * h * d, d, h * d, 1});
}

void validate_desc(const longctx_sdpa_desc &x) {
    if (x.dtype != LONGCTX_SDPA_BF16 && x.dtype != LONGCTX_SDPA_F16)
        throw Failure{LONGCTX_SDPA_UNSUPPORTED, "dtype code " + std::to_string(x.dtype) + " (bf16 or f16 expected)"};
    if (x.d <= 0 || x.d > 256 || x.d % 8 != 0)
        throw Failure{LONGCTX_SDPA_UNSUPPORTED,
                      "head dim " + std::to_string(x.d) + " (cuDNN needs a multiple of 8, at most 256)"};
    if (x.b <= 0 || x.s <= 0 || x.t <= 0 || x.hkv <= 0 || x.hq % x.hkv != 0)
        throw Failure{LONGCTX_SDPA_FAILED, "bad shape"};
    if (x.causal && x.s != x.t) throw Failure{LONGCTX_SDPA_FAILED, "causal block needs s == t"};
    if (x.band_left < 0 || x.band_right < 0 || (x.band_left > 0 && x.causal))
        throw Failure{LONGCTX_SDPA_FAILED, "bad band: left " + std::to_string(x.band_left) + ", right " +
                                               std::to_string(x.band_right) + (x.causal ? " with causal" : "")};
    if (x.band_left > INT32_MAX || x.band_right > INT32_MAX)
        throw Failure{LONGCTX_SDPA_UNSUPPORTED, "band bounds past int32"};
    // cudnn-frontend 1.16: "Sliding window attention is only supported with max_s_q <= max_s_kv"
    if (x.band_left > 0 && x.s > x.t)
        throw Failure{LONGCTX_SDPA_UNSUPPORTED, "sliding-window band block with s_q " + std::to_string(x.s) +
                                                    " > s_kv " + std::to_string(x.t) +
                                                    " (cuDNN needs s_q <= s_kv)"};
}

// The mask of `x` on either direction's attributes: causal, or a top-left aligned band.
template <typename Attrs>
void set_mask(Attrs &opts, const longctx_sdpa_desc &x) {
    if (x.causal) opts.set_causal_mask(true);
    if (x.band_left > 0) {
        opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
            .set_diagonal_band_right_bound(static_cast<int>(x.band_right))
            .set_diagonal_band_left_bound(static_cast<int>(x.band_left));
    }
}

// What a refusal names: the block's shape and mask.
std::string shape_of(const longctx_sdpa_desc &x) {
    std::string m = x.causal ? "causal" : "no mask";
    if (x.band_left > 0)
        m = "band left " + std::to_string(x.band_left) + " right " + std::to_string(x.band_right) + " (top-left)";
    return "b " + std::to_string(x.b) + ", s_q " + std::to_string(x.s) + ", s_kv " + std::to_string(x.t) + ", hq " +
           std::to_string(x.hq) + ", hkv " + std::to_string(x.hkv) + ", d " + std::to_string(x.d) + ", " + m;
}

// Builds (or finds) the graph for `x` in direction `bwd`.
std::shared_ptr<fe::graph::Graph> graph_locked(const longctx_sdpa_desc &x, bool bwd, cudnnHandle_t handle) {
    Key key{x.ordinal, x.dtype,      x.b,          x.s, x.t, x.hq, x.hkv, x.d, x.causal, x.band_left, x.band_right,
            float_bits(x.scale), bwd ? 1 : 0};
    auto it = g_graphs.find(key);
    if (it != g_graphs.end()) return it->second;

    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(x.dtype == LONGCTX_SDPA_BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = bshd(*g, "q", Q, x.b, x.s, x.hq, x.d);
    auto k = bshd(*g, "k", K, x.b, x.t, x.hkv, x.d);
    auto v = bshd(*g, "v", V, x.b, x.t, x.hkv, x.d);
    if (!bwd) {
        auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(x.scale);
        set_mask(opts, x);
        auto [o, stats] = g->sdpa(q, k, v, opts);
        set_bshd(o, O, x.b, x.s, x.hq, x.d);
        stats->set_output(true)
            .set_uid(STATS)
            .set_data_type(fe::DataType_t::FLOAT)
            .set_dim({x.b, x.hq, x.s, 1})
            .set_stride({x.hq * x.s, x.s, 1, 1});
    } else {
        auto o = bshd(*g, "o", O, x.b, x.s, x.hq, x.d);
        auto d_o = bshd(*g, "do", DO, x.b, x.s, x.hq, x.d);
        auto stats = g->tensor(fe::graph::Tensor_attributes()
                                   .set_name("stats")
                                   .set_uid(STATS)
                                   .set_data_type(fe::DataType_t::FLOAT)
                                   .set_dim({x.b, x.hq, x.s, 1})
                                   .set_stride({x.hq * x.s, x.s, 1, 1}));
        auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_bwd").set_attn_scale(x.scale);
        set_mask(opts, x);
        auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, opts);
        set_bshd(dq, DQ, x.b, x.s, x.hq, x.d);
        set_bshd(dk, DK, x.b, x.t, x.hkv, x.d);
        set_bshd(dv, DV, x.b, x.t, x.hkv, x.d);
    }
    const int U = LONGCTX_SDPA_UNSUPPORTED;
    const std::string what = std::string(bwd ? " (backward, " : " (forward, ") + shape_of(x) + ")";
    check_fe(g->validate(), U, ("graph validation" + what).c_str());
    check_fe(g->build_operation_graph(handle), U, ("operation graph" + what).c_str());
    check_fe(g->create_execution_plans({fe::HeurMode_t::A}), U, ("execution plans" + what).c_str());
    check_fe(g->check_support(handle), U, ("support check" + what).c_str());
    check_fe(g->build_plans(handle), U, ("plan build" + what).c_str());
    g_graphs.emplace(key, g);
    return g;
}

void run_locked(const longctx_sdpa_desc &x, bool bwd, std::unordered_map<int64_t, void *> &pack, void *stream) {
    validate_desc(x);
    load_cudnn_locked();
    cudnnHandle_t handle = handle_locked(x.ordinal);
    auto g = graph_locked(x, bwd, handle);
    auto cs = static_cast<cudaStream_t>(stream);
    auto st = fe::detail::set_stream(handle, cs);
    if (st != CUDNN_STATUS_SUCCESS) {
        throw Failure{LONGCTX_SDPA_FAILED, std::string("cudnnSetStream: ") + fe::detail::get_error_string(st)};
    }
    int64_t ws_size = 0;
    check_fe(g->get_workspace_size(ws_size), LONGCTX_SDPA_FAILED, "workspace size");
    void *ws = nullptr;
    if (ws_size > 0) check_cuda(cudaMallocAsync(&ws, static_cast<size_t>(ws_size), cs), "workspace allocation");
    auto res = g->execute(handle, pack, ws);
    if (ws != nullptr) check_cuda(cudaFreeAsync(ws, cs), "workspace free");
    check_fe(res, LONGCTX_SDPA_FAILED, "execute");
}

template <typename F>
int guarded(char *err, size_t len, F &&f) {
    try {
        std::lock_guard<std::mutex> lock(g_mu);
        f();
        return LONGCTX_SDPA_OK;
    } catch (const Failure &e) {
        write_err(err, len, e.msg);
        return e.code;
    } catch (const std::exception &e) {
        write_err(err, len, std::string("cuDNN attention: ") + e.what());
        return LONGCTX_SDPA_FAILED;
    } catch (...) {
        write_err(err, len, "cuDNN attention: unknown C++ exception");
        return LONGCTX_SDPA_FAILED;
    }
}

}  // namespace

extern "C" int longctx_sdpa_fwd(const longctx_sdpa_desc *desc, const void *q, const void *k, const void *v, void *o,
                                float *lse, void *stream, char *err, size_t err_len) {
    return guarded(err, err_len, [&] {
        std::unordered_map<int64_t, void *> pack{
            {Q, const_cast<void *>(q)}, {K, const_cast<void *>(k)}, {V, const_cast<void *>(v)}, {O, o}, {STATS, lse}};
        run_locked(*desc, false, pack, stream);
    });
}

extern "C" int longctx_sdpa_bwd(const longctx_sdpa_desc *desc, const void *q, const void *k, const void *v,
                                const void *o, const void *d_o, const float *lse, void *dq, void *dk, void *dv,
                                void *stream, char *err, size_t err_len) {
    return guarded(err, err_len, [&] {
        std::unordered_map<int64_t, void *> pack{{Q, const_cast<void *>(q)},
                                                 {K, const_cast<void *>(k)},
                                                 {V, const_cast<void *>(v)},
                                                 {O, const_cast<void *>(o)},
                                                 {DO, const_cast<void *>(d_o)},
                                                 {STATS, const_cast<float *>(lse)},
                                                 {DQ, dq},
                                                 {DK, dk},
                                                 {DV, dv}};
        run_locked(*desc, true, pack, stream);
    });
}

extern "C" int64_t longctx_sdpa_cudnn_version(char *err, size_t err_len) {
    int64_t version = 0;
    int rc = guarded(err, err_len, [&] {
        load_cudnn_locked();
        version = static_cast<int64_t>(fe::detail::get_backend_version());
    });
    return rc == LONGCTX_SDPA_OK ? version : 0;
}
