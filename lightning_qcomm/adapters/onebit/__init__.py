"""1-bit Adam's momentum sync over the 1-bit all-reduce (``sync``) and its overlap with backward (``overlap``)
(layer 3; docs/design.md, "Layers and files")."""
