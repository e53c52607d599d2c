"""CUDA thread-model emulator (test infrastructure, DESIGN §6): see cuda_emu.h."""
