"""DDP's communication hook for the compressed all-reduces: the hook (``hooks``), its config (``config``), the
bucket plan (``plan``) and the re-layout of buckets into per-rank shards (``relayout``)."""
