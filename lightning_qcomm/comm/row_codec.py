"""RowCodec: the wire format of one row of an FSDP2 flat communication buffer (DESIGN §2 "QSDP").

A row is the concatenation, in ``fsdp_params`` order, of each parameter's padded dim-0 shard. It is split
into *segments*, one per parameter shard. A segment is quantized with the codec when the parameter is
"large" (``ndim >= 2`` and ``numel >= min_quant_numel``, the CGX rule) and travels raw in the buffer dtype
otherwise (norm gains, biases). Quantized segments are bucketed on their own, so a bucket never mixes two
parameters' scales. The wire row is ``[seg_0 bytes | seg_1 bytes | ...]`` with ``codec.nbytes(n)`` bytes
(codes, then fp32 scales) per quantized segment and ``n * element_size`` per raw one: a pure function of
the layout and the buffer dtype, so no sizes are exchanged.

Example::

    rc = RowCodec([Segment(4096, True), Segment(64, False)], get_codec("uniform", bits=8))
    wire = rc.encode(rows, seed)              # (R, 4160) float -> (R, rc.row_nbytes(rows.dtype)) uint8
    rc.decode(wire, out, wire_dtype=rows.dtype)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_qcomm.codecs import Codec, Packed, derive_seed
from lightning_qcomm.comm.fsdp_internals import ParamShard

FP32_BYTES = 4


def is_quantized_param(p: ParamShard, min_quant_numel: int) -> bool:
    """Large matrices are quantized; vectors (norms, biases) and small tensors travel raw."""
    return p.ndim >= 2 and p.numel >= min_quant_numel


@dataclass(frozen=True)
class Segment:
    numel: int
    quantize: bool


class RowCodec:
    """Encodes R rows of one layout (R, S) into wire bytes (R, P) and back.

    ``segments`` partition S; quantized segments use ``codec``, raw ones the buffer dtype's bytes.
    """

    def __init__(self, segments: Sequence[Segment], codec: Codec | None) -> None:
        self.segments = [s for s in segments if s.numel > 0]
        self.codec = codec
        self.row_numel = sum(s.numel for s in self.segments)

    def row_nbytes(self, dtype: torch.dtype) -> int:
        es = torch.empty((), dtype=dtype).element_size()
        return sum(self._seg_nbytes(s, es) for s in self.segments)

    def _seg_nbytes(self, s: Segment, elem_size: int) -> int:
        return self.codec.nbytes(s.numel) if (s.quantize and self.codec is not None) else s.numel * elem_size

    def _aligned(self, n: int, rows: int) -> bool:
        """Whether R rows of a segment can be coded as one flat tensor with per-row byte boundaries."""
        if rows == 1:
            return True
        b = self.codec.bucket_size
        return b is not None and n % b == 0 and n % 8 == 0

    def encode(self, rows: torch.Tensor, seed: int) -> torch.Tensor:
        """rows (R, S) float -> uint8 (R, P)."""
        r_count = rows.shape[0]
        parts = []
        off = 0
        for k, s in enumerate(self.segments):
            x = rows[:, off : off + s.numel]
            off += s.numel
            if not (s.quantize and self.codec is not None):
                parts.append(x.contiguous().view(torch.uint8))
                continue
            seg_seed = derive_seed(seed, k)
            if self._aligned(s.numel, r_count):
                p = self.codec.encode(x.reshape(-1), seed=seg_seed)
                parts.append(p.codes.reshape(r_count, -1))
                parts.append(p.scales.reshape(r_count, -1).view(torch.uint8))
            else:
                parts.append(
                    torch.stack(
                        [self.codec.encode(x[r], seed=derive_seed(seg_seed, r)).to_bytes() for r in range(r_count)]
                    )
                )
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()

    def decode(
        self,
        buf: torch.Tensor,
        out: torch.Tensor,
        skip_row: int | None = None,
        wire_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """uint8 (R, P) -> writes ``out`` (R, S) (any float dtype); row ``skip_row`` is left as it is.

        Raw segments are read in ``wire_dtype``, the dtype they were encoded from (default ``out.dtype``):
        bit-exact when equal, an exact widening when ``out`` is wider (bf16/fp16 gradients into fp32).
        """
        r_count = buf.shape[0]
        wire_dtype = out.dtype if wire_dtype is None else wire_dtype
        es = torch.empty((), dtype=wire_dtype).element_size()
        boff = 0
        off = 0
        rows = [r for r in range(r_count) if r != skip_row]
        for s in self.segments:
            dst = out[:, off : off + s.numel]
            off += s.numel
            nb = self._seg_nbytes(s, es)
            src = buf[:, boff : boff + nb]
            boff += nb
            if not (s.quantize and self.codec is not None):
                for r in rows:
                    dst[r].copy_(src[r].clone().view(wire_dtype))  # clone: the byte offset may not be aligned
                continue
            aligned = self._aligned(s.numel, r_count)
            if out.dtype == torch.float32 and (skip_row is not None or aligned):
                # row by row straight into the output: same values as the batched decode (whole buckets
                # per row when aligned), no temporary and no copy
                for r in rows:
                    self.codec.decode_into(self.codec.from_bytes(src[r], (s.numel,), torch.float32), dst[r])
            elif aligned and skip_row is None:
                ncode = nb - self.codec.num_buckets(s.numel) * self.codec.scales_per_bucket * FP32_BYTES
                codes = src[:, :ncode].reshape(-1)
                scales = src[:, ncode:].contiguous().view(torch.float32).reshape(-1, self.codec.scales_per_bucket)
                packed = Packed(codes=codes, scales=scales, shape=torch.Size((r_count * s.numel,)), dtype=torch.float32)
                dst.copy_(self.codec.decode(packed).view(r_count, s.numel))
            else:
                for r in rows:
                    dst[r].copy_(self.codec.decode(self.codec.from_bytes(src[r], (s.numel,), torch.float32)))
        return out
