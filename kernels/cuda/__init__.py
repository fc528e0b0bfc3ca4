"""Triton kernels of the codec ops (``lightning_qcomm.kernels.cuda``): ``codec_kernels`` (encode / decode, one
tensor and rows), ``wire_params`` (the wire scales and parameters of every bucket in one launch) and
``elementwise`` (their shared device functions). The public entry points are re-exported by
``lightning_qcomm.kernels``.

Example::

    >>> from lightning_qcomm.kernels.cuda import codec_kernels, wire_params  # needs triton
    >>> codec_kernels.INT32_INDEX_LIMIT > 0 and callable(wire_params.fused_scales)
    True
"""
