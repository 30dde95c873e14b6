"""Public NKI sample kernels, ported by changing their imports (see each file)."""
