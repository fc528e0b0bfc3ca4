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

from lightning_qcomm.codecs import Codec, derive_seed
from lightning_qcomm.comm.fsdp_internals import ParamShard
from lightning_qcomm.comm.row_batch import decode_rows_into, encode_rows

DECODE_BLOCK_NUMEL = 1 << 24  # elements decoded per codec call at most (bounds the fp32 temporary)


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
            else:  # row r with seed derive_seed(seg_seed, r), all rows in one pass
                parts.append(encode_rows(self.codec, x, [derive_seed(seg_seed, r) for r in range(r_count)]))
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
        # row ranges to decode (all but ``skip_row``), in blocks that bound the fp32 temporary of a segment
        spans = [(0, r_count)] if skip_row is None else [(0, skip_row), (skip_row + 1, r_count)]
        for s in self.segments:
            dst = out[:, off : off + s.numel]
            off += s.numel
            nb = self._seg_nbytes(s, es)
            src = buf[:, boff : boff + nb]
            boff += nb
            raw = not (s.quantize and self.codec is not None)
            step = r_count if raw else max(1, DECODE_BLOCK_NUMEL // s.numel)
            for a0, a1 in spans:
                for r0 in range(a0, a1, step):
                    r1 = min(r0 + step, a1)
                    if raw:  # contiguous copy first: the byte offset may not be aligned for wire_dtype
                        dst[r0:r1].copy_(src[r0:r1].clone(memory_format=torch.contiguous_format).view(wire_dtype))
                    else:
                        decode_rows_into(self.codec, src[r0:r1], s.numel, dst[r0:r1])
        return out
