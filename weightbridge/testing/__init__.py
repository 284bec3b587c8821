"""Test tools shipped with the package (importable in Monarch procs): `emulated_cuda`, a CUDA
device that keeps real values on the host and enforces CUDA's device rules; `fuzz`, a protocol
fuzz of updates, deltas, joins, leaves, kills and stalls on the adapters in one process (every
sync mode)."""
