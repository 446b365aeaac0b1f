"""Compiled kernels below the layers and the solvers: Numba's CPU loops (cpu.py), the CUDA
source CuPy compiles (cuda.py), and the window geometry they share (geometry.py). They take
arrays and shapes and know no layer; the NumPy forms in engine/layers stay the reference."""
