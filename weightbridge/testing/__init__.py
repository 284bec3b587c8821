"""Test tools shipped with the package (importable in Monarch procs): `emulated_cuda`, a CUDA
device that keeps real values on the host and enforces CUDA's device rules. (The protocol
fuzz harnesses live with the tests: tests/fuzz_adapters.py, tests/fuzz_controller.py.)"""
