// CPU kernels of the qcomm torch ops: thin wrappers that check their tensors and call the C kernels of
// qcomm_kernels.h. Built against torch's stable C ABI (torch/csrc/stable), so it compiles in seconds and
// links only libtorch; lightning_qcomm/codecs/native.py builds and loads it on first use.
//
// The op schemas are defined in Python (lightning_qcomm/codecs/ops.py and sign_ops.py, with their fake and
// default kernels); this file registers the CPU kernels. Each function's parameters follow its schema in
// order; QC_SPEC_PARAMS follows layout.C_SPEC_SCHEMA (the fields of KernelSpec the C kernels read).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>

#include "qcomm_kernels.h"

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

#define QC_SPEC_PARAMS                                                                                    \
    int64_t kind, int64_t bits, int64_t bucket, bool stochastic, int64_t levels, int64_t sign_bit, int64_t emin, \
        int64_t mbits, int64_t bias, double fmax

namespace {

void check_tensor(const Tensor& t, ScalarType dtype, int64_t min_numel, const char* name) {
    STD_TORCH_CHECK(t.is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.numel() >= min_numel,
                    "qcomm: ", name, " must be a contiguous CPU tensor of the kernel's dtype with >= ", min_numel,
                    " elements");
}

const float* f32(const Tensor& t, int64_t n, const char* name) {
    check_tensor(t, ScalarType::Float, n, name);
    return static_cast<const float*>(t.const_data_ptr());
}

float* f32_out(const Tensor& t, int64_t n, const char* name) {
    check_tensor(t, ScalarType::Float, n, name);
    return static_cast<float*>(t.mutable_data_ptr());
}

const uint8_t* u8(const Tensor& t, int64_t n, const char* name) {
    check_tensor(t, ScalarType::Byte, n, name);
    return static_cast<const uint8_t*>(t.const_data_ptr());
}

uint8_t* u8_out(const Tensor& t, int64_t n, const char* name) {
    check_tensor(t, ScalarType::Byte, n, name);
    return static_cast<uint8_t*>(t.mutable_data_ptr());
}

int64_t packed_nbytes(int64_t n, int64_t bits) { return (n + 7) / 8 * bits; }

// Elements per bucket of an n-element tensor (bucket 0: one bucket).
int64_t bucket_len(int64_t bucket, int64_t n) { return bucket == 0 || bucket > n ? (n > 0 ? n : 1) : bucket; }

int64_t num_buckets(int64_t bucket, int64_t n) { return (n + bucket_len(bucket, n) - 1) / bucket_len(bucket, n); }

cfg_t make_cfg(int64_t P, QC_SPEC_PARAMS) {
    (void)bucket;
    STD_TORCH_CHECK(bits >= 1 && bits <= 8, "qcomm: bits must be in 1..8, got ", bits);
    cfg_t c = {};
    c.kind = static_cast<int>(kind);
    c.bits = static_cast<int>(bits);
    c.stoch = stochastic ? 1 : 0;
    c.P = static_cast<int>(P);
    c.levels = static_cast<int>(levels);
    c.sign_bit = static_cast<int>(sign_bit);
    c.emin = static_cast<int>(emin);
    c.mbits = static_cast<int>(mbits);
    c.bias = static_cast<int>(bias);
    c.fmax = static_cast<float>(fmax);
    return c;
}

// Packed codes of flat fp32 x given the per-bucket encode parameters (num_buckets, P); element j draws the
// random counter offset + j.
void c_encode_codes(Tensor x, Tensor params, int64_t k1, int64_t k2, QC_SPEC_PARAMS, Tensor out, int64_t offset) {
    const int64_t n = x.numel();
    STD_TORCH_CHECK(n > 0 && params.dim() == 2 && params.size(0) == num_buckets(bucket, n), "qcomm: params must be ",
                    "(num_buckets, P)");
    const cfg_t c = make_cfg(params.size(1), kind, bits, bucket, stochastic, levels, sign_bit, emin, mbits, bias, fmax);
    qc_encode(&c, f32(x, n, "x"), n, f32(params, params.numel(), "params"), bucket_len(bucket, n),
              static_cast<uint32_t>(k1), static_cast<uint32_t>(k2), offset, u8_out(out, packed_nbytes(n, bits), "out"));
}

// fp32 values of numel packed codes into out, from the decode parameters (num_buckets, P) and the 256-entry
// table of each code's value with unit parameters.
void c_decode_codes(Tensor codes, Tensor params, Tensor lut, int64_t numel, int64_t bits, int64_t bucket, Tensor out) {
    STD_TORCH_CHECK(numel > 0 && bits >= 1 && bits <= 8, "qcomm: need numel > 0 and bits in 1..8");
    STD_TORCH_CHECK(params.dim() == 2 && params.size(0) == num_buckets(bucket, numel), "qcomm: params must be ",
                    "(num_buckets, P)");
    qc_decode(u8(codes, packed_nbytes(numel, bits), "codes"), numel, static_cast<int>(bits),
              f32(params, params.numel(), "params"), static_cast<int>(params.size(1)), bucket_len(bucket, numel),
              f32(lut, 256, "lut"), f32_out(out, numel, "out"), 0);
}

// The uniform codec's decode straight from its (num_buckets, 2) wire scales (lo, unit; a negative unit flags a
// pre-scaled bucket): the parameters of UniformCodec._decode_params computed per bucket in the kernel.
void c_uniform_decode(Tensor codes, Tensor scales, int64_t numel, int64_t bits, int64_t bucket, Tensor out) {
    STD_TORCH_CHECK(numel > 0 && bits >= 1 && bits <= 8, "qcomm: need numel > 0 and bits in 1..8");
    STD_TORCH_CHECK(scales.dim() == 2 && scales.size(0) == num_buckets(bucket, numel) && scales.size(1) == 2,
                    "qcomm: scales must be (num_buckets, 2)");
    qc_decode(u8(codes, packed_nbytes(numel, bits), "codes"), numel, static_cast<int>(bits),
              f32(scales, scales.numel(), "scales"), 3, bucket_len(bucket, numel), nullptr,
              f32_out(out, numel, "out"), 1);
}

// Per-bucket min, max, max |x| and flags (bit 0: all finite, bit 1: both signed zeros occur).
void c_bucket_stats(Tensor x, int64_t bucket, Tensor lo, Tensor hi, Tensor amax, Tensor flags) {
    const int64_t n = x.numel();
    STD_TORCH_CHECK(n > 0, "qcomm: x must be non-empty");
    const int64_t nb = num_buckets(bucket, n);
    qc_stats(f32(x, n, "x"), n, bucket_len(bucket, n), f32_out(lo, nb, "lo"), f32_out(hi, nb, "hi"),
             f32_out(amax, nb, "amax"), u8_out(flags, nb, "flags"));
}

// codecs.qsgd.tree_norm of each row of the (n / width, width) x.
void c_tree_norm(Tensor x, int64_t width, Tensor out) {
    const int64_t n = x.numel();
    STD_TORCH_CHECK(n > 0 && width > 0 && n % width == 0, "qcomm: x must hold whole rows of width elements");
    qc_tree_norm(f32(x, n, "x"), n / width, width, f32_out(out, n / width, "out"));
}

void c_hadamard(Tensor x, int64_t block, double scale) {
    const int64_t n = x.numel();
    STD_TORCH_CHECK(block >= 1 && (block & (block - 1)) == 0 && n % block == 0,
                    "qcomm: c_hadamard needs whole blocks of a power-of-two size");
    qc_hadamard(f32_out(x, n, "x"), n, block, static_cast<float>(scale));
}

// The uniform codec's whole encode (scales, parameters, codes); false when a bucket needs the general path.
bool c_uniform_encode(Tensor x, int64_t k1, int64_t k2, QC_SPEC_PARAMS, Tensor scales, Tensor params, Tensor out,
                      int64_t offset) {
    const int64_t n = x.numel();
    STD_TORCH_CHECK(n > 0 && kind == QC_KIND_UNIFORM, "qcomm: c_uniform_encode needs a non-empty x, kind uniform");
    const int64_t nb = num_buckets(bucket, n);
    const cfg_t c = make_cfg(3, kind, bits, bucket, stochastic, levels, sign_bit, emin, mbits, bias, fmax);
    return qc_uniform_encode(&c, f32(x, n, "x"), n, bucket_len(bucket, n), static_cast<uint32_t>(k1),
                             static_cast<uint32_t>(k2), offset, f32_out(scales, 2 * nb, "scales"),
                             f32_out(params, 3 * nb, "params"), u8_out(out, packed_nbytes(n, bits), "out")) == 0;
}

void sign_encode_err(Tensor y, double scale, Tensor payload, Tensor err, int64_t valid, int64_t err_len) {
    const int64_t c = y.numel();
    STD_TORCH_CHECK(0 <= valid && valid <= err_len && err_len <= c, "qcomm: need 0 <= valid <= err_len <= len(y)");
    qc_sign_encode_err(f32(y, c, "y"), c, static_cast<float>(scale), u8_out(payload, (c + 7) / 8 + 4, "payload"),
                       f32_out(err, err_len, "err"), valid, err_len);
}

void sign_server_sum(Tensor buf, int64_t world, int64_t c, Tensor server_error, int64_t valid, Tensor z) {
    STD_TORCH_CHECK(world >= 1 && world <= 256 && c >= 0, "qcomm: world must be in [1, 256]");
    const int64_t p = (c + 7) / 8 + 4;
    const int64_t n = valid < 0 ? 0 : (valid < c ? valid : c);
    qc_sign_server_sum(u8(buf, world * p, "buf"), static_cast<int>(world), c, p, f32(server_error, n, "server_error"),
                       valid, f32_out(z, c, "z"));
}

void sign_decode(Tensor payload, int64_t c, Tensor out) {
    const int64_t length = out.numel();
    STD_TORCH_CHECK(length <= c, "qcomm: out has more elements than the payload");
    qc_sign_decode(u8(payload, (c + 7) / 8 + 4, "payload"), c, length, f32_out(out, length, "out"));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(qcomm, CPU, m) {
    m.impl("c_encode_codes", TORCH_BOX(&c_encode_codes));
    m.impl("c_decode_codes", TORCH_BOX(&c_decode_codes));
    m.impl("c_uniform_decode", TORCH_BOX(&c_uniform_decode));
    m.impl("c_bucket_stats", TORCH_BOX(&c_bucket_stats));
    m.impl("c_tree_norm", TORCH_BOX(&c_tree_norm));
    m.impl("c_hadamard", TORCH_BOX(&c_hadamard));
    m.impl("c_uniform_encode", TORCH_BOX(&c_uniform_encode));
    m.impl("sign_encode_err", TORCH_BOX(&sign_encode_err));
    m.impl("sign_server_sum", TORCH_BOX(&sign_server_sum));
    m.impl("sign_decode", TORCH_BOX(&sign_decode));
}
