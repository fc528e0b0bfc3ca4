"""RowCodec: the wire format of one row of an FSDP2 flat communication buffer (adapter layer; docs/design.md, "QSDP").

A row is the concatenation, in ``fsdp_params`` order, of each parameter's padded dim-0 shard, split into one
*segment* per parameter. A segment is quantized when the parameter is "large" (``ndim >= 2`` and ``numel >=
min_quant_numel``, the CGX rule) and travels raw in the buffer dtype otherwise (norm gains, biases); quantized
segments are bucketed on their own, so a bucket never mixes two parameters' scales. The wire row is ``[seg_0 |
seg_1 | ...]`` with ``codec.nbytes(n)`` bytes per quantized segment and ``n * element_size`` per raw one: a pure
function of the layout and the dtype, so no sizes are exchanged. A quantized segment of whole byte-aligned buckets
is coded as one flat tensor of its R rows (one seed), any other with row r's own seed ``derive_seed(seg_seed, r)``.

``encode`` writes into a buffer of the caller's ``PieceLayout`` (``comm.transport``). On CPU no temporary grows
with R: raw segments are copied in, and large quantized rows go through the fused C pass one at a time, straight
into the buffer; other rows (fewer elements, or on CUDA) are coded all together, in a number of ops that does not
depend on R.

Example::

    rc = RowCodec([Segment(4096, True), Segment(64, False)], get_codec("uniform", bits=8))
    wire = rc.encode(rows, seed)              # (R, 4160) float -> (R, rc.row_nbytes(rows.dtype)) uint8
    rc.decode(wire, out, wire_dtype=rows.dtype)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_qcomm.adapters.fsdp2.shim import ParamShard
from lightning_qcomm.codecs import Codec, derive_seed, encode_row, row_at_a_time, segments_fused
from lightning_qcomm.codecs.rows import decode_rows_into, encode_flat, encode_rows
from lightning_qcomm.codecs.rows_segments import as_dtype, decode_segments_into, decode_segments_sum, encode_segments
from lightning_qcomm.comm.transport import PieceLayout

DECODE_BLOCK_NUMEL = 1 << 24  # elements decoded per codec call at most (bounds the fp32 temporary)
# Most elements of a quantized segment's R rows coded together by the batched eager pass on CPU (the path
# CUDA takes, ops constant in R); past it the C pass codes them one row at a time, as the batched pass's
# temporaries (tens of bytes an element) would grow with R.
BATCH_MAX_NUMEL = 1 << 15
FUSED_OUT = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes the segment decode writes


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
        self.runs = self._merge_raw(self.segments)

    def _merge_raw(self, segments: list[Segment]) -> list[tuple[int, Segment]]:
        """(k, segment) in row order with adjacent raw segments joined into one (their bytes lie side by side in
        the row and on the wire: one copy each way instead of one per segment); k: the segment index a
        quantized segment's seed derives from (a raw run keeps its first segment's)."""
        runs: list[tuple[int, Segment]] = []
        for k, s in enumerate(segments):
            raw = not (s.quantize and self.codec is not None)
            if raw and runs and not runs[-1][1].quantize:
                runs[-1] = (runs[-1][0], Segment(runs[-1][1].numel + s.numel, False))
            else:
                runs.append((k, Segment(s.numel, not raw)))
        return runs

    def fused(self, t: torch.Tensor, r_count: int, dtype: torch.dtype, layout: PieceLayout | None = None) -> bool:
        """Whether R rows on ``t``'s device go through the segment ops (``codecs.rows_segments``: every segment of
        every row in two launches to encode, one to decode or sum, on CUDA): a codec whose segment kernels take
        this layout, rows stored plainly (no transport pieces), and no fused C pass (CPU keeps its row loop)."""
        if self.codec is None or (layout is not None and layout.pieced):
            return False
        return segments_fused(self.codec, t, *self._plan(), r_count, dtype)

    def _plan(self) -> tuple[list[int], list[bool]]:
        return [s.numel for _, s in self.runs], [s.quantize for _, s in self.runs]

    def _seeds(self, seed: int) -> list[int]:
        return [derive_seed(seed, k) for k, s in self.runs if s.quantize]

    def sum_into(
        self, recv: torch.Tensor, rows: torch.Tensor, own: int, out: torch.Tensor, layout: PieceLayout
    ) -> bool:
        """``out`` (S,) <- the rank-order sum of the received rows (flat, stored in ``layout``) decoded, row ``own``
        exact from ``rows`` (``decode_segments_sum``, one launch); False (nothing written) where ``fused`` does
        not hold."""
        if not self.fused(recv, layout.world, rows.dtype, layout):
            return False
        decode_segments_sum(self.codec, recv.view(layout.world, -1), rows, own, *self._plan(), out)
        return True

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

    def encode(
        self, rows: torch.Tensor, seed: int, out: torch.Tensor | None = None, layout: PieceLayout | None = None
    ) -> torch.Tensor:
        """rows (R, S) float -> uint8 (R, P); or written into ``out`` (flat, R * P bytes) stored in ``layout``,
        and ``out`` returned."""
        r_count = rows.shape[0]
        nbytes = self.row_nbytes(rows.dtype)
        if out is None:
            layout = PieceLayout(r_count, nbytes, ((0, nbytes),))
            return self.encode(rows, seed, layout.empty(rows.device), layout).view(r_count, nbytes)
        if layout is None or (layout.world, layout.row_bytes) != (r_count, nbytes) or out.numel() != r_count * nbytes:
            raise ValueError(f"out needs a PieceLayout of {r_count} rows of {nbytes} bytes and that many bytes")
        if self.fused(rows, r_count, rows.dtype, layout) and rows.stride(-1) == 1:
            encode_segments(self.codec, rows, *self._plan(), self._seeds(seed), out.view(r_count, nbytes))
            return out
        es = rows.element_size()
        off = boff = 0
        for k, s in self.runs:
            x = rows[:, off : off + s.numel]
            nb = self._seg_nbytes(s, es)
            if not s.quantize:
                layout.write(out, boff, (x if x.stride(-1) == 1 else x.contiguous()).view(torch.uint8))
            elif self._one_by_one(x):
                self._encode_one_by_one(x, derive_seed(seed, k), out, layout, boff, nb)
            else:
                self._encode_together(x, derive_seed(seed, k), out, layout, boff)
            off, boff = off + s.numel, boff + nb
        return out

    def _one_by_one(self, x: torch.Tensor) -> bool:
        """Whether the (R, n) rows of a quantized segment go through the C pass one at a time (CPU): rows of the
        fused path's size, or more than ``BATCH_MAX_NUMEL`` elements in all."""
        return row_at_a_time(self.codec, x, BATCH_MAX_NUMEL)

    def _encode_one_by_one(
        self, x: torch.Tensor, seg_seed: int, out: torch.Tensor, layout: PieceLayout, b0: int, nb: int
    ) -> None:
        """The C pass per row, straight into ``out`` (through one row's scratch where the row's bytes cross a piece
        boundary); rows of whole buckets as rows of one flat tensor, without a copy of the rows."""
        r_count, n = x.shape
        flat = self._aligned(n, r_count)
        scratch = None
        for r in range(r_count):
            dst = layout.span(out, r, b0, b0 + nb)
            if dst is None and scratch is None:
                scratch = torch.empty(nb, dtype=torch.uint8)
            target = scratch if dst is None else dst
            encode_row(self.codec, x, r, seg_seed if flat else derive_seed(seg_seed, r), target, flat)
            if dst is None:
                layout.write_row(out, r, b0, scratch)

    def _encode_together(self, x: torch.Tensor, seg_seed: int, out: torch.Tensor, layout: PieceLayout, b0: int) -> None:
        """All R rows in a number of ops that does not depend on R, copied into ``out``: rows of
        whole buckets as one flat codec call on a contiguous copy of the rows (on CUDA the Triton kernel's one
        launch; the copy is R x the segment, on the device), the others by ``encode_rows``."""
        r_count, n = x.shape
        if self._aligned(n, r_count):
            codes, scales = encode_flat(self.codec, x, seg_seed)
            layout.write(out, b0, codes)
            layout.write(out, b0 + codes.shape[1], scales)
        else:
            layout.write(out, b0, encode_rows(self.codec, x, [derive_seed(seg_seed, r) for r in range(r_count)]))

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
        if self.fused(buf, r_count, wire_dtype) and out.stride(-1) == 1 and out.dtype in FUSED_OUT:
            return decode_segments_into(self.codec, buf, *self._plan(), wire_dtype, out, skip_row)
        es = torch.empty((), dtype=wire_dtype).element_size()
        boff = 0
        off = 0
        # row ranges to decode (all but ``skip_row``), in blocks that bound the fp32 temporary of a segment
        spans = [(0, r_count)] if skip_row is None else [(0, skip_row), (skip_row + 1, r_count)]
        for _, s in self.runs:
            dst = out[:, off : off + s.numel]
            off += s.numel
            nb = self._seg_nbytes(s, es)
            src = buf[:, boff : boff + nb]
            boff += nb
            raw = not s.quantize
            step = r_count if raw else max(1, DECODE_BLOCK_NUMEL // s.numel)
            for a0, a1 in spans:
                for r0 in range(a0, a1, step):
                    r1 = min(r0 + step, a1)
                    if raw:
                        dst[r0:r1].copy_(as_dtype(src[r0:r1], wire_dtype))
                    else:
                        decode_rows_into(self.codec, src[r0:r1], s.numel, dst[r0:r1])
        return out
