"""The codec contract: ``Codec.encode(x, seed) -> Packed`` and ``Codec.decode(Packed) -> Tensor`` (docs/design.md,
"Codecs").

Every codec works on the flattened input split into buckets of ``bucket_size`` elements (the last one may be
short); per bucket a few fp32 *scales* travel with the densely bit-packed codes (``layout``), so a tensor of d
elements takes ``nbytes(d) = ceil(d / 8) * bits + ceil(d / B) * scales_per_bucket * 4`` bytes.

Invariants: a bucket containing NaN or +-Inf gets a NaN scale and decodes non-finite, so compression never makes
non-finite gradients finite; a finite bucket decodes finite, also at the ends of fp32's range (buckets pre-scaled by
a power of two, flagged in a scale's sign: ``codecs.scaling``); the codecs work in fp32 (an fp64 input beyond fp32's
range is +-Inf there). The per-element work has a torch reference here, a C kernel (``kernels/cpu``) and a Triton
kernel (``lightning_qcomm.kernels``), all given the per-bucket parameters computed by torch, so all give the same
codes for the same seed. ``encode`` / ``decode`` call the ops ``qcomm::encode`` / ``decode`` (``codecs.ops``),
whose kernel the dispatcher picks by device, and ``torch.compile`` traces through them; a codec class that is not
the one registered under its name (``codecs.registry``) may override the math and runs this reference directly.

Example::

    codec = get_codec("uniform", bits=8, bucket_size=512)
    x_hat = codec.decode(codec.encode(x, seed=7))     # unbiased: E[x_hat] == x
"""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from lightning_qcomm.codecs import layout, registry, rng, scaling
from lightning_qcomm.codecs.layout import KernelKind, KernelSpec

log = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_PIECE = 1 << 16  # elements per piece of the reference's element-wise work (see Codec._pieces)


@dataclass(frozen=True)
class Packed:
    """A compressed tensor: packed codes, per-bucket fp32 scales, and what is needed to rebuild it.

    Example::

        packed = get_codec("uniform", bits=4).encode(x, seed=1)
        wire = packed.to_bytes()    # codes then fp32 scales: codec.nbytes(x.numel()) bytes
    """

    codes: torch.Tensor  # uint8, flat, ceil(numel/8)*bits bytes
    scales: torch.Tensor  # float32, (num_buckets, scales_per_bucket)
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: packed codes (with padding) plus scales. Shape and dtype are agreed
        by both sides of a collective, so no header travels."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4

    def to_bytes(self) -> torch.Tensor:
        """One flat uint8 buffer (codes then scales), the form collectives send."""
        return torch.cat([self.codes.reshape(-1), self.scales.reshape(-1).view(torch.uint8)])


class Codec(ABC):
    """Base class: bucketing, validation, padding, packing, and the calls into the ``qcomm`` ops.

    Subclasses define the math through four hooks, all on fp32:
    ``_scales`` (per-bucket wire scales), ``_encode_params`` / ``_decode_params`` (per-bucket
    parameters derived from the scales) and ``_quantize`` / ``_dequantize`` (element-wise); a class with
    native kernels also gives their constants (``kernel_spec``). ``min_bits`` / ``max_bits`` are set by
    ``register_codec`` (these defaults hold for an unregistered subclass).

    Example::

        codec = get_codec("uniform", bits=8)       # a registered subclass
        y = codec.decode(codec.encode(x, seed=3))  # the quantized round trip of x
    """

    name: str = ""
    scales_per_bucket: int = 1
    stochastic: bool = True
    min_bits: int = 1
    max_bits: int = 8
    # Which exact per-bucket statistic the wire scales are a function of, for the fused CPU path (which
    # computes it in C): "minmax" (lo, hi), "amax" (max |x|), or None (an L2 norm, qsgd.tree_norm: computed
    # from the bucket itself).
    scale_statistic: str | None = None
    # Whether the last bucket decodes the same padded with zero codes to a full bucket, as ``codecs.rows`` repacks
    # rows that are not whole buckets (False where the bucket's length is part of the math: eden's rotation).
    tail_pads: bool = True

    def __init__(self, bits: int, bucket_size: int | None = 512) -> None:
        if not isinstance(bits, int) or isinstance(bits, bool):
            raise TypeError(f"bits must be an int, got {type(bits).__name__}")
        if not self.min_bits <= bits <= self.max_bits:
            raise ValueError(
                f"bits={bits} is not supported by codec {self.name!r}: allowed {self.min_bits}..{self.max_bits}"
            )
        if bucket_size is not None:
            if not isinstance(bucket_size, int) or isinstance(bucket_size, bool):
                raise TypeError(f"bucket_size must be an int or None, got {type(bucket_size).__name__}")
            if bucket_size < 1:
                raise ValueError(f"bucket_size must be >= 1 (or None for one bucket), got {bucket_size}")
        self.bits = bits
        self.bucket_size = bucket_size

    def config(self) -> dict[str, object]:
        """Every constructor option with its value, plus the class and name: what defines the codes.

        Read off the ``__init__`` signature (every option is stored under its own name), so an option a
        subclass adds is covered without listing it here. Two codecs with equal ``config()`` produce the
        same bytes for the same input and seed; the cross-rank consistency check compares this.

        Example::

            >>> get_codec("uniform", bits=4, stochastic=False).config()["stochastic"]
            False
        """
        names = [n for n in inspect.signature(type(self).__init__).parameters if n != "self"]
        return {"class": type(self).__qualname__, "name": self.name, **{n: getattr(self, n) for n in names}}

    def __repr__(self) -> str:
        cfg = self.config()
        return f"{cfg.pop('class')}(" + ", ".join(f"{k}={v!r}" for k, v in cfg.items()) + ")"

    # ------------------------------------------------------------------ sizes
    def bucket_len(self, numel: int) -> int:
        """Elements per bucket for a tensor of ``numel`` elements."""
        return numel if self.bucket_size is None else min(self.bucket_size, max(numel, 1))

    def num_buckets(self, numel: int) -> int:
        return -(-numel // self.bucket_len(numel))

    def nbytes(self, numel: int) -> int:
        """Wire bytes of a tensor of ``numel`` elements (codes + padding + scales)."""
        return layout.packed_nbytes(numel, self.bits) + self.num_buckets(numel) * self.scales_per_bucket * 4

    def compression_ratio(self, numel: int) -> float:
        """nbytes / fp32 bytes."""
        return self.nbytes(numel) / (4 * numel)

    # ------------------------------------------------------------------ math hooks
    @abstractmethod
    def _scales(self, xb: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Wire scales (nb, scales_per_bucket) from the zero-padded buckets ``xb`` (nb, B) and the
        number of real elements per bucket."""

    @abstractmethod
    def _encode_params(self, scales: torch.Tensor, out_max: float = scaling.FLT_MAX) -> torch.Tensor:
        """Per-bucket fp32 parameters (nb, P) the element-wise quantizer multiplies / adds with; no code may
        decode past ``out_max`` (``scaling.output_max`` of the input dtype)."""

    @abstractmethod
    def _decode_params(self, scales: torch.Tensor) -> torch.Tensor:
        """Per-bucket fp32 parameters (nb, P) the element-wise dequantizer uses."""

    @abstractmethod
    def _quantize(self, x: torch.Tensor, params: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """Codes (int64, in [0, 2**bits)) of x (n,) given per-element params (n, P) and uniforms u."""

    @abstractmethod
    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """fp32 values of int64 codes (n,) given per-element params (n, P)."""

    # ------------------------------------------------------------------ what the ops and kernels carry
    def op_args(self) -> tuple[str, int, int | None, bool]:
        """``(codec, bits, bucket_size, stochastic)``: how the ``qcomm`` ops name this codec;
        ``registry.codec_for_op`` rebuilds it (with ``op_options``)."""
        return (self.name, self.bits, self.bucket_size, bool(self.stochastic))

    @classmethod
    def op_options(cls, stochastic: bool) -> dict[str, object]:
        """Constructor options that give ``stochastic`` (none by default: the class fixes it)."""
        return {}

    def kernel_spec(self) -> KernelSpec:
        """Kind and constants of the native kernels (classes registered with ``kernels=True``)."""
        raise NotImplementedError(f"codec {self.name!r} has no native kernel")

    def _spec(self, kind: KernelKind, enc_params: int, dec_params: int, **consts) -> KernelSpec:
        bucket = 0 if self.bucket_size is None else self.bucket_size
        return KernelSpec(kind, self.bits, bucket, bool(self.stochastic), enc_params, dec_params, **consts)

    # ------------------------------------------------------------------ public API
    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"x must be a floating tensor ({', '.join(str(d) for d in FLOAT_DTYPES)}), got dtype {x.dtype}"
            )
        if x.numel() == 0:
            raise ValueError(f"x must be non-empty, got shape {tuple(x.shape)}")

    def _buckets(self, xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = xf.numel()
        blen = self.bucket_len(n)
        nb = -(-n // blen)
        xb = torch.nn.functional.pad(xf, (0, nb * blen - n)).view(nb, blen)
        counts = torch.full((nb,), blen, dtype=torch.float32, device=xf.device)
        counts[-1:].fill_(n - (nb - 1) * blen)  # fill_ takes the number as a kernel argument: no host copy
        return xb, counts

    def _finite_mask(self, xb: torch.Tensor) -> torch.Tensor:
        # x - x is +0 for finite x and NaN for +-Inf / NaN, so a row sums to 0 iff it is all finite
        # (two cheap passes instead of torch.isfinite's four).
        return (xb - xb).sum(dim=1, keepdim=True) == 0

    def encode(self, x: torch.Tensor, seed: int = 0) -> Packed:
        """Compress ``x`` (any shape, fp32/fp16/bf16/fp64). ``seed`` keys the random bits (see
        ``rng.derive_seed`` to fold in step, rank and tensor id)."""
        self._check_input(x)
        if registry.is_registered(self):  # the op: the dispatcher picks C / Triton / the reference
            codes, scales = torch.ops.qcomm.encode(x.detach(), *self.op_args(), rng.signed_seed(seed))
        else:
            xf = x.detach().reshape(-1).to(torch.float32)
            codes, scales = self.encode_torch(xf, seed, scaling.output_max(x.dtype))
        return Packed(codes=codes, scales=scales, shape=x.shape, dtype=x.dtype)

    def bucket_scales(self, xf: torch.Tensor) -> torch.Tensor:
        """Wire scales (num_buckets, scales_per_bucket) of flat fp32 ``xf``, NaN for a bucket holding a
        non-finite element."""
        xb, counts = self._buckets(xf)
        scales = self._scales(xb, counts)
        return torch.where(self._finite_mask(xb), scales, torch.full_like(scales, float("nan")))

    def encode_torch(self, xf: torch.Tensor, seed: int, out_max: float, elementwise=None):
        """(codes, wire scales) of flat fp32 ``xf``: scales and parameters in torch, then ``elementwise(xf,
        enc_params, seed)`` (default: ``encode_reference``; the CUDA kernel passes the Triton one)."""
        scales = self.bucket_scales(xf)
        enc_params = self._encode_params(scales, out_max)
        codes = (elementwise or self.encode_reference)(xf, enc_params, seed)
        return codes, scales.contiguous()

    def _pieces(self, numel: int, device: torch.device):
        """Split 0..numel into pieces ``(start, rows, length, first_bucket)`` of whole buckets, or of parts
        of one bucket, about ``_PIECE`` elements each on the CPU: the element-wise work runs piece by piece on
        (rows, length) views with per-bucket parameters broadcast along a row, so it stays in cache and
        never materialises per-element parameters. On an accelerator a piece is the whole tensor (the full
        buckets, then the tail): a few large launches instead of thousands of small ones. The random bits
        are keyed by element offset, so the codes do not depend on the split."""
        piece = _PIECE if device.type == "cpu" else max(numel, 1)
        blen = self.bucket_len(numel)
        full = numel // blen
        if blen <= piece:
            step = piece // blen
            for b in range(0, full, step):
                rows = min(step, full - b)
                yield b * blen, rows, blen, b
        else:
            for b in range(full):
                for s in range(0, blen, piece):
                    yield b * blen + s, 1, min(piece, blen - s), b
        tail = numel - full * blen
        for s in range(0, tail, piece):
            yield full * blen + s, 1, min(piece, tail - s), full

    def encode_reference(self, xf: torch.Tensor, enc_params: torch.Tensor, seed: int) -> torch.Tensor:
        """Torch reference of the element-wise encode: packed uint8 codes of flat fp32 ``xf``."""
        n = xf.numel()
        codes = torch.zeros(layout.packed_nbytes(n, 8), dtype=torch.uint8, device=xf.device)  # zero padding
        for start, rows, length, b in self._pieces(n, xf.device):
            end = start + rows * length
            x = xf[start:end].reshape(rows, length)
            params = enc_params[b : b + rows].unsqueeze(-1)  # (rows, P, 1): params[:, k] broadcasts over a row
            u = rng.uniform(seed, end - start, xf.device, offset=start).view(rows, length) if self.stochastic else None
            c = self._quantize(x, params, u)
            # Non-finite inputs (and every element of their bucket, whose params are NaN) get code 0:
            # the NaN scale already makes their decode non-finite, and the codes stay deterministic.
            ok = (x - x == 0) & torch.isfinite(params).all(dim=1)  # x - x == 0: x finite
            codes[start:end].view(rows, length).copy_(c.masked_fill_(~ok, 0))
        return layout.pack_bits(codes, self.bits)

    def decode(self, p: Packed) -> torch.Tensor:
        """Rebuild a tensor of ``p.shape`` and ``p.dtype``."""
        if not isinstance(p, Packed):
            raise TypeError(f"p must be a Packed, got {type(p).__name__}")
        if registry.is_registered(self):
            out = torch.ops.qcomm.decode(p.codes, p.scales, p.numel, *self.op_args())
        else:
            out = self.decode_reference(p.codes, self._decode_params(p.scales), p.numel)
        return out.to(p.dtype).reshape(p.shape)

    def decode_into(self, p: Packed, out: torch.Tensor) -> torch.Tensor:
        """``out.copy_(decode(p))`` for an ``out`` of ``p.numel`` elements; the fused CPU kernel writes the
        values straight into a contiguous fp32 ``out`` (no temporary)."""
        if not isinstance(p, Packed):
            raise TypeError(f"p must be a Packed, got {type(p).__name__}")
        if out.numel() != p.numel:
            raise ValueError(f"out has {out.numel()} elements, the payload {p.numel}")
        if registry.is_registered(self):
            torch.ops.qcomm.decode_into(p.codes, p.scales, *self.op_args(), p.dtype, out)
            return out
        return out.copy_(self.decode(p).view(out.shape))

    def decode_reference(self, codes: torch.Tensor, dec_params: torch.Tensor, numel: int) -> torch.Tensor:
        """Torch reference of the element-wise decode: flat fp32 values."""
        c_all = layout.unpack_bits(codes, self.bits, numel)
        out = torch.empty(numel, dtype=torch.float32, device=codes.device)
        for start, rows, length, b in self._pieces(numel, codes.device):
            end = start + rows * length
            c = c_all[start:end].view(rows, length).to(torch.int64)
            out[start:end].view(rows, length).copy_(self._dequantize(c, dec_params[b : b + rows].unsqueeze(-1)))
        return out

    def from_bytes(self, buf: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Packed:
        """Inverse of ``Packed.to_bytes`` for a tensor of the given shape (sizes follow ``nbytes``)."""
        shape = torch.Size(shape)
        n = 1
        for s in shape:
            n *= s
        ncodes = layout.packed_nbytes(n, self.bits)
        nb = self.num_buckets(n)
        if buf.numel() != self.nbytes(n):
            raise ValueError(
                f"buf has {buf.numel()} bytes, codec {self.name} expects {self.nbytes(n)} for {n} elements"
            )
        codes = buf[:ncodes]
        # clone: a view at a byte offset that is not a multiple of 4 cannot be reinterpreted as fp32
        scales = buf[ncodes:].clone().view(torch.float32).reshape(nb, self.scales_per_bucket)
        return Packed(codes=codes, scales=scales, shape=shape, dtype=dtype)

    def roundtrip(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """decode(encode(x)): what the receiver sees."""
        return self.decode(self.encode(x, seed))
