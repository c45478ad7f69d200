"""The FlashAttention-4 backend (``backend.FA4Backend``): a tile list as FA4 varlen / window / block-sparse calls
(``calls``), per-head block selections as FA4 block-sparse calls (``sparse``); Triton where FA4 cannot run."""
