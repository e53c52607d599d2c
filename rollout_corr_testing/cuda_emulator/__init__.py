"""CUDA thread-model emulator (test infrastructure, docs/cuda_kernels.md): see cuda_emu.h."""
