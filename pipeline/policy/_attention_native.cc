// Decode-step attention on CPU for rlstream's engine, as an XLA FFI custom call.
//
// One query token per row against that row's key-value cache: for each row b and
// key-value head k, the `group` query heads that share the head attend to the cache
// positions 0..positions[b] (causal; positions past the end are clamped to it, a
// negative position attends to nothing and gives zeros). XLA runs the same step as 2 x
// batch x kv_heads separate small matrix products, each a call of its own; this kernel
// reads each cached key and value once per row and head, and only up to the row's
// position, on XLA's own intra-op thread pool. Built by pipeline/policy/native_attention.py,
// which checks it against the einsum reference (tests/unit/test_native_attention.py).
//
//   q          f32[B, K, G, D]   the step's queries, already rotated
//   k_cache    f32[B, K, S, D]   keys, this step's written at its position
//   v_cache    f32[B, K, S, D]
//   positions  s32[B]            each row's position (the last key it may read)
//   out        f32[B, K, G, D]   softmax(q k^T / sqrt(D)) v

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

void attend_one(const float* __restrict q, const float* __restrict keys,
                const float* __restrict values, float* __restrict out, int64_t groups,
                int64_t dim, int64_t length, float scale, float* __restrict scores) {
  for (int64_t g = 0; g < groups; ++g) {
    float* __restrict o = out + g * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = 0.0f;
  }
  if (length <= 0) return;
  // scores[g][s] = q[g] . keys[s]: each key row read once for all query heads of its group
  for (int64_t s = 0; s < length; ++s) {
    const float* __restrict key = keys + s * dim;
    for (int64_t g = 0; g < groups; ++g) {
      const float* __restrict qg = q + g * dim;
      float acc = 0.0f;
      for (int64_t d = 0; d < dim; ++d) acc += qg[d] * key[d];
      scores[g * length + s] = acc * scale;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* __restrict row = scores + g * length;
    float top = row[0];
    for (int64_t s = 1; s < length; ++s) top = std::max(top, row[s]);
    float total = 0.0f;
    for (int64_t s = 0; s < length; ++s) {
      row[s] = std::exp(row[s] - top);
      total += row[s];
    }
    const float inv = 1.0f / total;
    for (int64_t s = 0; s < length; ++s) row[s] *= inv;
  }
  // out[g] = sum_s p[g][s] values[s]: each value row read once for all query heads
  for (int64_t s = 0; s < length; ++s) {
    const float* __restrict value = values + s * dim;
    for (int64_t g = 0; g < groups; ++g) {
      const float p = scores[g * length + s];
      float* __restrict o = out + g * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] += p * value[d];
    }
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                               ffi::Buffer<ffi::S32> positions,
                               ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k_cache.dimensions();
  auto vd = v_cache.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin())) {
    return ffi::Error::InvalidArgument("decode attention: q [B,K,G,D], caches [B,K,S,D]");
  }
  const int64_t batch = qd[0], heads = qd[1], groups = qd[2], dim = qd[3];
  const int64_t slots = kd[2];
  if (kd[0] != batch || kd[1] != heads || kd[3] != dim ||
      positions.element_count() != static_cast<size_t>(batch)) {
    return ffi::Error::InvalidArgument("decode attention: shapes of q, caches and positions differ");
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const float* qp = q.typed_data();
  const float* kp = k_cache.typed_data();
  const float* vp = v_cache.typed_data();
  const int32_t* pos = positions.typed_data();
  float* op = out->typed_data();

  const int64_t items = batch * heads;
  auto run = [=](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(groups * slots));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads;
      const int64_t length = std::min<int64_t>(static_cast<int64_t>(pos[b]) + 1, slots);
      attend_one(qp + i * groups * dim, kp + i * slots * dim, vp + i * slots * dim,
                 op + i * groups * dim, groups, dim, length, scale, scores.data());
    }
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), items));
  if (workers == 1) {
    run(0, items);
    return ffi::Error::Success();
  }
  // rows handed out in chunks to whoever asks: the calling thread works too, so the step
  // finishes even if no pool thread ever starts; it then waits only for chunks under way.
  // The shared state outlives this call (a task may start after the step has returned).
  struct Work {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
  };
  auto work = std::make_shared<Work>();
  const int64_t chunk = std::max<int64_t>(1, items / (4 * workers));
  auto drain = [=](Work& state) {
    for (;;) {
      state.active.fetch_add(1, std::memory_order_acq_rel);
      const int64_t begin = state.next.fetch_add(chunk, std::memory_order_acq_rel);
      if (begin >= items) {
        state.active.fetch_sub(1, std::memory_order_acq_rel);
        return;
      }
      run(begin, std::min(items, begin + chunk));
      state.active.fetch_sub(1, std::memory_order_acq_rel);
    }
  };
  for (int64_t w = 1; w < workers; ++w) {
    pool.Schedule([work, drain]() { drain(*work); });
  }
  drain(*work);
  while (work->active.load(std::memory_order_acquire) > 0) {
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlstreamDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
