"""FP8 forms of the GeGLU MLP: e4m3 weights with 128 x 128 block scales and dynamic
per-row activation scales (transformers' FineGrainedFP8, ``FP8Linear``), inference only.

  kernels.py   device code: quantization, the FP8 GEMMs, the FP8 one-launch MLP
  gemm.py      their host side: launch plans, checked entry points, cuBLAS's FP8 GEMM
  mlp.py       the FP8 MLP as a custom op: which kernels at which size
  modules.py   FP8Linear projections read for the layers, and the layers' FP8 path
  checks.py    input checks
"""
