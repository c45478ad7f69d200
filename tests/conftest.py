"""Test-session set-up. This is the CPU suite: Triton kernels run through Triton's interpreter, which
must be switched on before anything imports triton (a test file cannot do it once another one has)."""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(__file__))  # tests' shared helpers (_dist, reference)
