"""DDP's communication hook for the compressed all-reduces (layer 3; docs/design.md, "Layers and files"): the hook
(``hooks``), its config (``config``), the bucket plan (``plan``) and the replay of a saved bucket layout on resume
(``relayout``)."""
