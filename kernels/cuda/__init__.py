"""Triton kernels of the codec ops (``lightning_qcomm.kernels.cuda``; docs/design.md, "Layers and files").

Eight modules: ``codec_kernels`` (encode / decode of one tensor and of rows), ``wire_params`` (the wire scales and
encode parameters of every bucket in one launch), ``norms`` (the norm codecs' per-bucket helpers it calls),
``elementwise`` (the device functions they share), ``reduce_kernels`` (the compressed all-reduce's server sum and
error-feedback tail), ``segment_kernels`` (QSDP's rows of quantized and raw segments) ``rotation_kernels``
(the Hadamard transform of whole blocks) and ``rounding_kernels`` (1-bit Adam's bf16 variance window). The public entry points
are re-exported by ``lightning_qcomm.kernels``; these modules read only the codec layer's spec modules.

Example::

    >>> from lightning_qcomm.kernels.cuda import codec_kernels, wire_params  # needs triton
    >>> codec_kernels.INT32_INDEX_LIMIT > 0 and callable(wire_params.fused_scales)
    True
"""
