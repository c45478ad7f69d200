"""The Triton backend (``backend.TritonBackend``): forward and backward kernels over block schedules of a tile list
(``fwd``, ``bwd``, ``delta``, ``blocks``), per-head block selections (``sparse``), and dense pieces on cuDNN
(``cudnn``)."""
