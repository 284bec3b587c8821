"""Test tools shipped with the package (usable in Monarch procs): `emulated_cuda`."""
