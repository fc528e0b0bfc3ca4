"""The framework adapters (layer 3; docs/design.md, "Layers and files"): how the compressed collectives plug into
torch's training machinery, one folder each with its own config.

* ``adapters.ddp``: DDP's communication hook (``hooks``), its state and config (``config``), the bucket plan
  (``plan``) and the replay of a saved bucket layout on resume (``relayout``);
* ``adapters.fsdp2``: QSDP's quantized all-gather and reduce-scatter on FSDP2's comm hooks (``comms``), their
  installation (``install``), the deferred reduce-scatter (``deferred``), master-weight projection (``master``),
  QSDP's row layout (``row_codec``) and the one module that reads FSDP2's private state (``shim``);
* ``adapters.onebit``: 1-bit Adam's momentum sync (``sync``) and its overlap with backward (``overlap``).
"""
