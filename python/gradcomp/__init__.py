"""gradcomp: gradient compression for data-parallel training.

The PyTorch integration lives in :mod:`gradcomp.torch` (a DistributedDataParallel
communication hook); the library itself is header-only C++ (include/gradcomp).
"""
