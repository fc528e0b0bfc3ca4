"""QSDP on FSDP2 (layer 3; docs/design.md, "Layers and files"): the quantized weight all-gather and gradient
reduce-scatter (``comms``), installed on FSDP2's comm hooks (``install``), the reduce-scatter deferred to the end of
backward (``deferred``), master weights (``master``), the row layout of a shard (``row_codec``); ``shim`` is the one
module that reads FSDP2's private state, one branch per torch release."""
